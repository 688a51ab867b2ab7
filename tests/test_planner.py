"""Segment planner: valid plans for every geometry, the strategy, the schema, and calibrated
predictions against the engine's measured peak."""

import argparse
import gc
import json
import sys

import mlx.core as mx
import pytest
from mlx_lm.tuner.utils import linear_to_lora_layers

from segback.engine import memory, value_and_grad
from segback.engine.attention import use_attention
from segback.engine.options import EngineOptions
from segback.engine.memory import GB
from segback.models.random_init import build_model, geometry_config
from segback.engine import Plan, PlanError
from segback.engine.plan_file import SCHEMA
from segback.planner import fit_coefficients, plan_segments, read_geometry
from segback.planner.cli import add_arguments, main

def validate(plan: Plan) -> None:
    """The plan round-trips plan.schema.json unchanged."""
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


GEOMETRIES = ["tiny-llama", "tiny-gemma3", "tiny-e4b", "e4b"]


def assert_covers(plan, n):
    segs = plan.segments
    assert segs[0][0] == 0 and segs[-1][1] == n
    for (a, b), (c, _) in zip(segs, segs[1:]):
        assert a < b == c
    assert len(plan.layer_types) == n


@pytest.mark.parametrize("name", GEOMETRIES)
@pytest.mark.parametrize("attention", ["fused", "chunked"])
def test_plans_cover_all_layers(name, attention):
    n = geometry_config(name)["num_hidden_layers"]
    for seq in (256, 4096):
        bits = 4 if name == "e4b" else None
        plan = plan_segments(name, seq, attention=attention, quant_bits=bits)
        assert_covers(plan, n)
        validate(plan)
        assert plan.meets_target and plan.predicted_relative_step_time >= 1.0


def test_e4b_plan_is_config_only_and_reads_geometry():
    plan = plan_segments("e4b", 8192, quant_bits=4)
    assert mx.get_active_memory() < 1 << 30  # nothing of e4b's weights was materialized
    types = plan.layer_types
    assert [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11, 17, 23, 29, 35, 41]
    # 4-bit weights: ~4-6 GB, not the ~16 GB of float32
    assert 3.0 < plan.breakdown["weights"] < 7.0
    donors = {kv["donor"]: kv for kv in plan.saved_kv}
    assert set(donors) == {22, 23}  # sharers 24..41 read donor 22 (sliding) and 23 (full)
    assert donors[23]["sharer_layers"] == [29, 35, 41]


def test_tight_target_isolates_full_attention_layers():
    free = plan_segments("e4b", 8192, quant_bits=4)
    floor = free.predicted_peak_gb
    plan = plan_segments("e4b", 8192, quant_bits=4, target_gb=floor * 1.05)
    assert plan.meets_target and plan.predicted_peak_gb <= floor * 1.05
    for a, b in plan.segments:
        if any(plan.layer_types[i] == "full_attention" for i in range(a, b)):
            assert b - a <= 2, plan.segments
    # a loose target takes fewer, larger segments
    loose = plan_segments("e4b", 8192, quant_bits=4, target_gb=floor * 2)
    assert loose.meets_target and len(loose.segments) < len(plan.segments)


def test_chunked_attention_lowers_the_long_context_peak():
    fused = plan_segments("e4b", 32768, quant_bits=4)
    chunked = plan_segments("e4b", 32768, quant_bits=4, attention="chunked")
    assert chunked.predicted_peak_gb < 0.6 * fused.predicted_peak_gb
    # with chunked attention the full layers (O(L x chunk)) are the heavy ones
    worst = max(range(len(chunked.segments)), key=lambda k: chunked.segment_gb[k])
    a, b = chunked.segments[worst]
    assert "full_attention" in chunked.layer_types[a:b]


def test_target_below_floor_returns_minimum_plan():
    free = plan_segments("tiny-e4b", 1024)
    plan = plan_segments("tiny-e4b", 1024, target_gb=1e-6)
    assert not plan.meets_target
    assert "cannot be met" in plan.message
    assert plan.segments == free.segments
    assert plan.predicted_peak_gb == pytest.approx(free.predicted_peak_gb)
    validate(plan)


def test_time_budget_limits_segment_count():
    free = plan_segments("e4b", 8192, quant_bits=4, attention="chunked")
    budget = free.predicted_relative_step_time - 0.02
    plan = plan_segments("e4b", 8192, quant_bits=4, attention="chunked", time_budget=budget)
    assert plan.predicted_relative_step_time <= budget
    assert len(plan.segments) < len(free.segments)
    too_fast = plan_segments("e4b", 8192, quant_bits=4, time_budget=1.0)
    assert not too_fast.meets_time_budget and len(too_fast.segments) == 1


def test_schema_rejects_bad_plans():
    plan = plan_segments("tiny-llama", 512)
    validate(plan)
    d = plan.to_dict()
    for bad, where in (({**d, "segments": "all"}, "segments"),
                       ({**d, "segments": [[0, 1.5], [1.5, 4]]}, "segments/[01]/[01]"),
                       ({k: v for k, v in d.items() if k != "inputs"}, "top level"),
                       ({k: v for k, v in d.items() if k != "segments"}, "top level"),
                       ({**d, "inputs": {**d["inputs"], "attention": "flash"}}, "inputs")):
        with pytest.raises(PlanError, match=f"at {where}"):
            Plan.from_dict(bad)
    json.loads(SCHEMA.read_text())


def test_cli_writes_valid_plan(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "plan.json"
    args = parser.parse_args(["--model", "tiny-gemma3", "--seq", "2048", "--target-gb", "1",
                              "--attention", "chunked", "--out", str(out)])
    assert main(args) == 0
    plan = Plan.read(out)
    validate(plan)
    assert plan.inputs["model"] == "tiny-gemma3" and plan.inputs["attention"] == "chunked"


# --- calibrated predictions against the engine ------------------------------------------------

# Wide enough that activations dominate MLX's small fixed allocations, narrow enough to run
# in seconds on CPU.
CALIBRATED = {
    "dense": geometry_config("tiny-llama", hidden_size=128, intermediate_size=384,
                             num_attention_heads=2, num_key_value_heads=1),
    # 8 layers: sssssF donors, then a sliding and a full sharer (reading donors 4 and 5)
    "tiny-e4b": geometry_config("tiny-e4b", hidden_size=128, intermediate_size=384,
                                num_attention_heads=2, head_dim=32, global_head_dim=64,
                                sliding_window=64, num_hidden_layers=8, num_kv_shared_layers=2,
                                layer_types=["sliding_attention"] * 5 + ["full_attention"]
                                + ["sliding_attention", "full_attention"]),
}


def lora_model(config):
    model = build_model(config)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 20.0, "dropout": 0.0})
    mx.eval(model.parameters())
    return model


def measured_step_bytes(model, seq_len, segments, attention="fused"):
    """Peak above resting of one engine step (loss + grads), as MLX counts live buffers."""
    if attention == "chunked":
        layer_module = sys.modules[type(model.layers[0]).__module__]
        with use_attention([layer_module]):
            return measured_step_bytes(model, seq_len, segments)
    mx.random.seed(0)
    batch = mx.random.randint(0, model.args.vocab_size, (1, seq_len + 1))
    lengths = mx.array([[1, seq_len]])
    mx.eval(batch)
    peaks = []
    for _ in range(3):  # MLX's CPU scheduler varies the peak a little: take the median of 3
        gc.collect()
        mx.clear_cache()
        memory.reset_peak()
        base = mx.get_active_memory()
        (loss, _), grads = value_and_grad(model, batch, lengths, segments)
        mx.eval(loss, grads)
        peaks.append(mx.get_peak_memory() - base)
        del loss, grads
    return sorted(peaks)[1]


# chunked attention needs MaskSpec masks for sliding layers (not built yet): dense only
@pytest.mark.parametrize("name,attention",
                         [("dense", "fused"), ("dense", "chunked"), ("tiny-e4b", "fused")])
def test_calibrated_prediction_matches_engine(name, attention):
    model = lora_model(CALIBRATED[name])
    geom = read_geometry(model)
    coef = fit_coefficients(model, geom, attention=attention)  # 1, 2 layers at L = 512, 1024
    assert coef.calibrated and coef.activation > 0 and coef.attention > 0
    grads = geom.lora_params * 4
    for seq_len in (512, 1024, 2048):  # activations dominate fixed overheads
        chosen = plan_segments(model, seq_len, coefficients=coef, attention=attention)
        validate(chosen)
        assert chosen.inputs["calibration"]["segments"] == coef.segments
        pairs = plan_segments(model, seq_len, coefficients=coef, attention=attention,
                              segments=2)  # predict only
        for plan in (chosen, pairs):
            bd = plan.breakdown
            predicted = (plan.predicted_peak_gb - bd["weights"] - bd["lora_optimizer"]) * GB
            predicted += grads  # the step's gradients are live; AdamW's moments are not
            measured = measured_step_bytes(model, seq_len, plan, attention)
            assert abs(predicted - measured) <= 0.2 * measured, (seq_len, predicted, measured)


@pytest.mark.parametrize("name,tile,offload,segments",
                         [("tiny-e4b", 256, False, None), ("dense", 128, True, 1)])
def test_tiled_prediction_matches_engine(name, tile, offload, segments):
    """The tiled engine's cost model (uncalibrated): within 25% of the measured peak where the
    whole-sequence arrays dominate (4K here), and conservative (over, never far over) below."""
    model = lora_model(CALIBRATED[name])
    grads = read_geometry(model).lora_params * 4
    for seq_len, low, high in ((1024, 1.0, 2.2), (4096, 0.75, 1.25)):
        plan = plan_segments(model, seq_len, tile=tile, offload=offload, segments=segments)
        validate(plan)
        engine = plan.engine
        assert (engine.attention, engine.tile, engine.offload) == ("fused", tile, offload)
        bd = plan.breakdown
        predicted = (plan.predicted_peak_gb - bd["weights"] - bd["lora_optimizer"]) * GB
        measured = measured_step_bytes(model, seq_len, plan)  # the engine reads tile/offload
        assert low * measured <= predicted + grads <= high * measured, (seq_len, predicted,
                                                                         measured)


@pytest.mark.parametrize("name", ["dense", "tiny-e4b"])
def test_mlp_chunks_lower_the_measured_peak_as_predicted(name):
    """Untiled plans with `mlp_chunk`: the engine's peak drops, and the uncalibrated model
    predicts both within 20%."""
    model = lora_model(CALIBRATED[name])
    grads = read_geometry(model).lora_params * 4
    for seq_len in (1024, 2048):
        measured = {}
        for chunk in (None, 256):
            plan = plan_segments(model, seq_len, segments=1,
                                 options=EngineOptions(mlp_chunk=chunk))
            validate(plan)
            assert plan.engine.mlp_chunk == chunk and plan.engine.tile is None
            bd = plan.breakdown
            predicted = (plan.predicted_peak_gb - bd["weights"] - bd["lora_optimizer"]) * GB
            measured[chunk] = measured_step_bytes(model, seq_len, plan)
            assert abs(predicted + grads - measured[chunk]) <= 0.2 * measured[chunk], \
                (seq_len, chunk, predicted + grads, measured[chunk])
        assert measured[256] < 0.95 * measured[None], (seq_len, measured)


def test_tile_auto_weighs_mlp_chunks_between_untiled_and_tiles():
    """e4b at 4K, 4-bit, the table parked, activations as counted on CUDA: whole MLPs do not
    fit 8 GB, chunked ones do and are predicted faster than any tile; with room, whole MLPs
    (no recompute) win; a tile and an MLP chunk together are refused."""
    coef = {"activation": 1.6}
    options = EngineOptions(host_table=True)
    tight = plan_segments("e4b", 4096, quant_bits=4, tile="auto", offload="auto", target_gb=8,
                          coefficients=coef, options=options)
    assert tight.meets_target and tight.engine.tile is None and tight.engine.mlp_chunk == 1024
    whole = plan_segments("e4b", 4096, quant_bits=4, target_gb=8, coefficients=coef,
                          options=options)
    assert not whole.meets_target
    roomy = plan_segments("e4b", 4096, quant_bits=4, tile="auto", offload="auto", target_gb=12,
                          coefficients=coef, options=options)
    assert roomy.engine.tile is None and roomy.engine.mlp_chunk is None
    assert roomy.predicted_relative_step_time < tight.predicted_relative_step_time
    with pytest.raises(ValueError, match="mlp_chunk is for untiled plans"):
        plan_segments("e4b", 4096, quant_bits=4, tile=1024, options=EngineOptions(mlp_chunk=512))


def test_tiling_plans_long_context_e4b_under_the_untiled_floor():
    """e4b at 128K: the untiled (chunked) floor is ~90 GB; tiles with host-parked boundaries
    bring the plan under 24 GB, and `tile="auto"` picks the fastest configuration meeting a
    target (untiled when it fits, as at 8K)."""
    untiled = plan_segments("e4b", 131072, quant_bits=4, attention="chunked")
    tiled = plan_segments("e4b", 131072, quant_bits=4, tile=1024, offload=True)
    assert untiled.predicted_peak_gb > 60 and tiled.predicted_peak_gb < 24
    assert tiled.predicted_host_gb > 1 and untiled.predicted_host_gb == 0
    # Offload keeps the per-layer embedding table (4-bit: 1.59 GB) in host memory.
    on_device = plan_segments("e4b", 131072, quant_bits=4, tile=1024, offload=False)
    moved = on_device.breakdown["weights"] - tiled.breakdown["weights"]
    assert moved * GB == 262144 * 42 * 256 * (4 / 8 + 2 * 2 / 64)
    assert tiled.predicted_relative_step_time > untiled.predicted_relative_step_time
    # The untiled engine parks it too when asked (on CUDA by default): same weights as offload.
    parked = plan_segments("e4b", 131072, quant_bits=4, attention="chunked",
                           options=EngineOptions(host_table=True))
    assert parked.breakdown["weights"] == tiled.breakdown["weights"]
    assert parked.predicted_host_gb * GB == moved * GB
    assert parked.engine.host_table is True and untiled.engine.host_table is None
    validate(tiled)
    validate(parked)
    auto = plan_segments("e4b", 131072, quant_bits=4, tile="auto", offload="auto", target_gb=24)
    assert auto.meets_target and auto.engine.tile and auto.predicted_peak_gb <= 24
    assert auto.inputs["tile"] == "auto"
    short = plan_segments("e4b", 8192, quant_bits=4, tile="auto", target_gb=30)
    assert short.engine.tile is None and short.meets_target
    with pytest.raises(ValueError, match="offload needs a tile"):
        plan_segments("e4b", 8192, quant_bits=4, offload=True)


def test_unquantized_geometry_counts_lora_not_base_weights_as_trainable(tmp_path):
    """A geometry or checkpoint is a base model: rank-r LoRA on every linear trains (AdamW's
    grads + 2 moments, float32), not its float weights."""
    # tiny-llama, per layer: q 64->64, k/v 64->32, o 64->64, gate/up 64->128, down 128->64
    per_layer = 8 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)
    expected = 4 * per_layer * 4 * 3 / GB
    assert plan_segments("tiny-llama", 512).breakdown["lora_optimizer"] == pytest.approx(
        expected)
    from mlx_lm.utils import save_model

    save_model(tmp_path, build_model("tiny-llama"))
    (tmp_path / "config.json").write_text(json.dumps(geometry_config("tiny-llama")))
    plan = plan_segments(str(tmp_path), 512)
    assert plan.breakdown["lora_optimizer"] == pytest.approx(expected)


def test_plan_is_refused_for_another_model_or_a_longer_sequence():
    """A plan carries what it was made for; the engine refuses it elsewhere."""
    plan = plan_segments("tiny-llama", 64, tile=32, offload=True)
    assert plan.engine.tile == 32 and plan.inputs["num_layers"] == 4
    model = lora_model("tiny-llama")
    ok = mx.random.randint(0, model.args.vocab_size, (1, 65))
    (loss, _), _ = value_and_grad(model, ok, mx.array([[0, 64]]), plan)  # runs as planned
    assert float(loss) > 0
    long = mx.random.randint(0, model.args.vocab_size, (1, 129))
    with pytest.raises(PlanError, match="made for sequences of 64 tokens"):
        value_and_grad(model, long, mx.array([[0, 128]]), plan)
    other = lora_model("tiny-gemma3")
    batch = mx.random.randint(0, other.args.vocab_size, (1, 65))
    with pytest.raises(PlanError, match="make a plan for this model"):
        value_and_grad(other, batch, mx.array([[0, 64]]), plan)
    with pytest.raises(PlanError, match="made for batches of 1"):
        value_and_grad(model, mx.concatenate([ok, ok]), mx.array([[0, 64]] * 2), plan)


def test_plan_engine_options_round_trip_and_old_plan_files(tmp_path):
    """Run-time options given to the planner travel in the plan; plan files written with the
    old top-level keys are still read."""
    from segback.engine import EngineOptions

    plan = plan_segments("tiny-llama", 64, tile=16, offload=True,
                         options=EngineOptions(tiles_in_flight=1, compile=False))
    assert (plan.engine.tiles_in_flight, plan.engine.compile) == (1, False)
    validate(plan)
    old = plan.to_dict()
    engine = old.pop("engine")
    old.update(attention="chunked", tile=engine["tile"], offload=True, offload_keep=0,
               light_tile=None)
    old["inputs"]["offload_keep"] = old["inputs"].pop("boundaries_on_device")
    (tmp_path / "old.json").write_text(json.dumps(old))
    read = Plan.read(tmp_path / "old.json")
    assert read.segments == plan.segments and read.engine.tile == 16 and read.engine.offload


def test_search_space_reads_what_the_planner_chooses_once():
    """`SearchSpace.from_dict` types the options as a command line or config gives them, 'auto'
    where the planner chooses; what the engine could not run is refused, 'auto' or not."""
    from segback.engine.options import AUTO, OptionsError
    from segback.planner.space import SearchSpace

    space = SearchSpace.from_dict({"tile": "auto", "offload": "true", "offload_keep": "2"})
    assert space == SearchSpace(tile=AUTO, offload=True, boundaries_on_device=2)
    assert SearchSpace() == SearchSpace.from_dict({}) and SearchSpace().boundaries_on_device == AUTO
    for values, message in (({"attention": "auto"}, "attention has no 'auto'"),
                            ({"tile": "0"}, "tile must be a positive number"),
                            ({"offload": "true"}, "offload needs a tile"),
                            ({"light_tile": "64"}, "light_tile needs a tile"),
                            ({"tile": "64", "boundaries_on_device": "1"}, "needs offload"),
                            ({"compile": "true"}, "the planner does not search compile")):
        with pytest.raises(OptionsError, match=message):
            SearchSpace.from_dict(values)


def test_measured_choice_is_the_fastest_measured_within_the_target():
    """--measure times candidates on the real model; the plan is the fastest measured that fits,
    and it says so (records in inputs.measured, in the cost model's order)."""
    plan = plan_segments("tiny-llama", 64, target_gb=1.0, measure=3, measure_budget=100)
    recs = plan.inputs["measured"]
    assert len(recs) == 3 and [r["index"] for r in recs] == [0, 1, 2]
    assert all(0 < r["peak_gb"] <= 1.0 and r["seconds"] > 0 for r in recs)
    best = min(recs, key=lambda r: r["seconds"])
    assert len(plan.segments) == best["segments"] and plan.meets_target
    assert plan.message.startswith("measured 3 of ")


def test_measured_choice_falls_back_to_the_smallest_measured_peak():
    from segback.engine.plan_file import Plan
    from segback.planner.measure import measured_pick

    model = build_model("tiny-llama")
    model.freeze()
    plans = [Plan(segments=[(0, 4)]), Plan(segments=[(0, 1), (1, 2), (2, 3), (3, 4)])]
    chosen, recs = measured_pick(model, [(k, lambda p=p: p) for k, p in enumerate(plans)],
                                 1e-6, 64, 1, 4, limit=1)
    assert len(recs) == 2  # nothing fit within the limit: it went on measuring
    assert not any(r["fits"] for r in recs)
    assert chosen is plans[min(recs, key=lambda r: r["peak_gb"])["index"]]


def test_measured_choice_bisects_a_configuration_for_its_fastest_plan_within_the_target():
    """Plans of one configuration get smaller along the cost model's order: over the target at
    its fastest, the search times the smallest, then bisects, instead of timing every cut."""
    from segback.engine.plan_file import Plan
    from segback.planner.measure import measure_plan, measured_pick
    from segback.planner.search import MARGIN

    model = build_model("tiny-llama")
    model.freeze()
    plans = [Plan(segments=[(0, 4)])] * 5 + [Plan(segments=[(0, 1), (1, 2), (2, 3), (3, 4)])] * 4
    one, four = (measure_plan(model, plans[i], 64)["peak_gb"] for i in (0, -1))
    assert four < one
    target = (one + four) / 2 / (1 - MARGIN)  # what fits: a measured peak under target - 2%
    chosen, recs = measured_pick(model, [("same", lambda p=p: p) for p in plans], target, 64,
                                 1, 4, limit=1)
    assert [r["index"] for r in recs] == [0, 8, 4, 6, 5]  # first, last, then halving
    assert [r["fits"] for r in recs] == [False, True, False, True, True]
    assert chosen is plans[5]


def test_measure_auto_times_candidates_only_on_a_gpu_with_a_target():
    from segback.planner.measure import AUTO_MEASURE, measure_count, parse_measure

    gpu = mx.default_device() == mx.gpu
    assert measure_count("auto", 8.0) == (AUTO_MEASURE if gpu else 0)
    assert measure_count("auto", None) == 0 and measure_count(2, None) == 2
    assert parse_measure(" Auto ") == "auto" and parse_measure("4") == 4
    for bad in ("-1", "two"):
        with pytest.raises(ValueError, match="auto or a whole number"):
            parse_measure(bad)
    plan = plan_segments("tiny-llama", 64, target_gb=1.0, measure="auto")  # the CPU: no timing
    assert "measured" not in plan.inputs or gpu


def test_uncalibrated_coefficients_follow_the_device():
    """On CUDA a plan's activations count 1.6x (fitted on an H100); everywhere else the
    analytic sizes stand, so CPU plans are unchanged."""
    from segback.planner.cost import CUDA_ACTIVATION, Coefficients, device_coefficients

    cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    assert device_coefficients() == (Coefficients(activation=CUDA_ACTIVATION) if cuda
                                     else Coefficients())
    given = plan_segments("e4b", 2048, quant_bits=4, target_gb=8, measure=0,
                          coefficients=Coefficients())
    default = plan_segments("e4b", 2048, quant_bits=4, target_gb=8, measure=0)
    assert (default.predicted_peak_gb > given.predicted_peak_gb) == cuda


def test_cost_model_stays_within_10_percent_of_the_peaks_measured_on_cuda():
    """Every e4b plan measured on an H100 in runs h100-run17…21 (bench/data/runs.jsonl: 2K-128K,
    untiled, chunked MLPs, tiles 256-4096, batch 1-4), predicted again by today's cost model
    with the CUDA activation factor: within 10% of its measured peak."""
    import importlib.util
    from pathlib import Path

    from segback.planner.cost import CUDA_ACTIVATION
    from segback.planner.geometry import resolve_model

    path = Path(__file__).resolve().parents[1] / "bench" / "planner_check.py"
    spec = importlib.util.spec_from_file_location("planner_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    found = check.plans(check.measured_rows(["h100-run17", "h100-run18", "h100-run19",
                                               "h100-run20", "h100-run21"]))
    kinds = {("tiled" if p["tile"] else "mlp" if p["mlp_chunk"] else "untiled") for p in found}
    assert len(found) > 100 and kinds == {"tiled", "mlp", "untiled"}
    assert max(p["seq"] for p in found) == 131072
    model, model_id = resolve_model("e4b", "bfloat16", 4)
    geom = read_geometry(model, 8, None, "bfloat16", model_id)
    for p in found:
        predicted = check.predict(geom, p, CUDA_ACTIVATION)
        assert abs(predicted - p["peak_gb"]) <= 0.10 * p["peak_gb"], (p, predicted)


def test_cost_model_stays_within_10_percent_of_llama8b_tiled_peaks_on_cuda():
    """Every Llama-3.1-8B tiled plan measured on CUDA (runs h200-run23, h100-run24, h100-run27:
    32K and 128K, tile 4096 with offload, MLX's kernel and the flash kernel), predicted again
    with the CUDA activation factor: within 10%. (Its untiled 8K plans are 15-19% low: open,
    bench/RESULTS.md.)"""
    import importlib.util
    from pathlib import Path

    from segback.planner.cost import CUDA_ACTIVATION
    from segback.planner.geometry import resolve_model

    path = Path(__file__).resolve().parents[1] / "bench" / "planner_check.py"
    spec = importlib.util.spec_from_file_location("planner_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    found = [p for p in check.plans(check.measured_rows(
        ["h200-run23", "h100-run24", "h100-run27"], model="llama-3.1-8b")) if p["tile"]]
    assert {p["seq"] for p in found} == {32768, 131072}
    model, model_id = resolve_model("llama-3.1-8b", "bfloat16", 4)
    geom = read_geometry(model, 8, None, "bfloat16", model_id)
    for p in found:
        predicted = check.predict(geom, p, CUDA_ACTIVATION)
        assert abs(predicted - p["peak_gb"]) <= 0.10 * p["peak_gb"], (p, predicted)


@pytest.mark.parametrize("name,heads,kv_heads,head_dim,full,window,weights_gb", [
    ("llama-3.1-8b", 32, 8, 128, list(range(32)), None, (3.5, 5.0)),
    ("mistral-7b-v0.3", 32, 8, 128, list(range(32)), None, (3.3, 4.5)),
    ("gemma-3-12b", 16, 8, 256, list(range(5, 48, 6)), 1024, (5.5, 7.5)),
])
def test_real_family_plans_read_their_geometry_without_weights(name, heads, kv_heads, head_dim,
                                                               full, window, weights_gb):
    """The real-size geometries (4-bit) plan from their config alone: layer kinds, windows and
    heads as the model's config.json says, the weights' bytes at 4 bits."""
    from segback.planner.geometry import resolve_model

    plan = plan_segments(name, 32768, quant_bits=4, target_gb=24, tile="auto", offload="auto")
    assert mx.get_active_memory() < 1 << 30  # nothing of the 7-12B weights was materialized
    assert_covers(plan, len(plan.layer_types))
    validate(plan)
    assert [i for i, t in enumerate(plan.layer_types) if t == "full_attention"] == full
    assert plan.meets_target and plan.inputs["quant_bits"] == 4
    assert weights_gb[0] < plan.breakdown["weights"] < weights_gb[1]
    geom = read_geometry(resolve_model(name, "bfloat16", 4)[0], 8, None, "bfloat16", name)
    for i, g in enumerate(geom.layers):
        assert (g.heads, g.head_dim, g.kv_width) == (heads, head_dim, kv_heads * head_dim)
        assert g.window == (None if i in full else window)
        assert g.kv_source == i and g.bits == 4


def test_timing_candidates_stays_within_three_of_the_picks_predicted_steps(capsys):
    """--measure N is bounded by the budget: the candidates' warm-up and timed steps together
    take at most MEASURE_BUDGET predicted steps of the cost model's pick (one candidate at the
    default, as the next would make four), or none, with a note, when one would not fit."""
    from segback.planner.measure import MEASURE_BUDGET, MEASURE_STEPS

    pick = plan_segments("tiny-llama", 64, target_gb=1.0, measure=0, dtype="float32")
    budget = MEASURE_BUDGET * pick.predicted_relative_step_time
    plan = plan_segments("tiny-llama", 64, target_gb=1.0, measure=10)
    recs = plan.inputs["measured"]
    assert len(recs) == 1 and recs[0]["segments"] == len(pick.segments)
    assert sum(MEASURE_STEPS * r["relative_time"] for r in recs) <= budget
    assert "past its budget" in capsys.readouterr().out
    assert len(plan_segments("tiny-llama", 64, target_gb=1.0, measure=10,
                             measure_budget=100).inputs["measured"]) == 4  # every cut
    skipped = plan_segments("tiny-llama", 64, target_gb=1.0, measure=3, measure_budget=1.5)
    assert "measured" not in skipped.inputs and skipped.segments == pick.segments
    assert "not timing candidates" in skipped.message
    assert "not timing candidates" in capsys.readouterr().out


def test_auto_timing_skips_a_lone_candidate_far_under_its_target():
    """--measure-plan auto (the GPU default) does not time a lone candidate whose prediction
    leaves the cost model's largest recorded error to spare under the target: Llama-8B at 128K
    (h100-run27) timed one such plan for 341 s. Two affordable candidates, or a target within
    that error, are timed; an explicit N always is (the tests above)."""
    from segback.planner.measure import MEASURE_BUDGET, MEASURE_STEPS, PREDICTION_DOUBT
    from segback.planner.measure import why_not_timed
    from segback.planner.search import MARGIN

    budget = MEASURE_BUDGET * 1.6039  # the 128K plan's relative step time, as recorded
    note = why_not_timed([1.6039, 1.62], [45.94, 45.0], 72.0, budget)
    assert note and "45.94 GB" in note and "72 GB" in note
    tight = 45.94 * (1 + PREDICTION_DOUBT) / (1 - MARGIN)
    assert why_not_timed([1.6039, 1.62], [45.94, 45.0], tight * 0.99, budget) is None
    assert why_not_timed([1.6039, 1.62], [45.94, 45.0], tight * 1.01, budget)
    assert why_not_timed([1.0, 1.0], [45.94, 45.0], 72.0, MEASURE_STEPS * 2.0) is None
    assert why_not_timed([1.6039], [45.94], None, budget) is None  # no target: no doubt


def test_a_plan_measured_over_its_target_is_not_chosen():
    """The cost model's pick measures over the target: it is not chosen; the fastest plan whose
    prediction, scaled by the measured overshoot, meets the target is (untimed: the budget is
    spent), and it says so."""
    from segback.planner.measure import measure_plan
    from segback.planner.search import MARGIN

    fastest = plan_segments("tiny-llama", 512, target_gb=10.0, measure=0, dtype="float32")
    model = build_model("tiny-llama")
    model.freeze()
    measured = measure_plan(model, fastest, 512)["peak_gb"]
    predicted = fastest.predicted_peak_gb
    assert measured > 1.01 * predicted  # on the CPU the untiled step peaks a few % above
    target = (predicted + measured) / 2 / (1 - MARGIN)  # predicted within it, measured not
    plan = plan_segments("tiny-llama", 512, target_gb=target, measure=3)
    (rec,) = plan.inputs["measured"]
    assert rec["segments"] == len(fastest.segments) and not rec["fits"]
    assert plan.segments != fastest.segments and plan.meets_target
    ratio = rec["peak_gb"] / rec["predicted_gb"]
    assert plan.predicted_peak_gb * ratio <= target * (1 - MARGIN)
    assert "the measured overshoot" in plan.message and "not timed" in plan.message
    # and it peaks lower than the pick, measured back to back (memory other tests of this
    # process left alive shifts both peaks alike)
    assert measure_plan(model, plan, 512)["peak_gb"] < measure_plan(model, fastest, 512)["peak_gb"]


def test_measure_plan_is_one_flag_on_plan_train_and_bench():
    """`--measure-plan` names the planner's timed candidates on every command (segback train's
    spelling); `--measure`, the old spelling of plan and bench, still parses the same."""
    import argparse

    from segback.benchmark.cli import add_arguments as bench_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--model", "tiny-llama", "--seq", "64", "--out", "plan.json"]
    assert p.parse_args([*base, "--measure-plan", "2"]).measure == 2
    assert p.parse_args([*base, "--measure", "2"]).measure == 2
    b = argparse.ArgumentParser()
    bench_arguments(b)
    short = ["--model", "tiny-llama", "--seq", "64"]
    assert b.parse_args([*short, "--measure-plan", "0"]).measure == 0
    assert b.parse_args([*short, "--measure", "1"]).measure == 1


def test_offloading_plans_park_no_more_than_the_host_memory_given(tmp_path):
    """Llama-3.1-8B at 512K tokens parks a 4 GB boundary per segment: with a host bound the
    planner takes fewer segments (parking less) within the device target, and says so; a
    bound no plan can meet gives the plan parking least, said not to meet its target."""
    from segback.planner.host import available_host_gb, host_budget_gb
    from segback.planner.search import MARGIN

    def plan(host):
        return plan_segments("llama-3.1-8b", 524288, target_gb=72, tile=4096, offload=True,
                             quant_bits=4, dtype="bfloat16", host_gb=host)

    free = plan(None)
    bounded = plan(0.5 * free.predicted_host_gb)
    assert free.meets_target and bounded.meets_target
    assert bounded.predicted_host_gb <= 0.5 * free.predicted_host_gb
    assert len(bounded.segments) < len(free.segments)
    assert "parking at most" in bounded.message
    assert bounded.predicted_peak_gb <= 72 * (1 - MARGIN)
    tight = plan(1.0)
    assert not tight.meets_target and "host memory" in tight.message
    assert len(tight.segments) == 1  # one boundary parked: the least any plan parks
    assert host_budget_gb(None) is None and host_budget_gb(12) == 12.0
    found = available_host_gb()
    assert found is not None and host_budget_gb("auto") == pytest.approx(0.85 * found, rel=0.05)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8388608 kB\n")
    assert available_host_gb(meminfo) == 8.0
    from segback.planner.cli import host_gb

    assert host_gb("auto") == "auto" and host_gb("None") is None and host_gb("96") == 96.0
    for bad in ("-1", "0", "nan", "lots"):
        with pytest.raises(argparse.ArgumentTypeError, match="GB > 0"):
            host_gb(bad)
