"""Where a chunking model decides how many chunks to list: teacher-forced on the gold answers.

At each chunk's end in a gold answer the next token is either `"},{"` (another chunk follows) or
the answer's close. For every test case this prints, at each of those points, the model's
probability of going on (C) against closing (E), marked with what the gold does. A model that
reads the transcript is sure of both; one that guesses the count from the usual number of
chunks hesitates from the second chunk on. One JSON line per case, then a summary line.

    python bench/chunk_stops.py --model results/gemma3/model \\
        --adapter results/gemma3/seq2048/adapter --data results/gemma3/data/test.jsonl
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    import mlx.core as mx

    from segback.chunking.prompt import build_prompt, gold_completion
    from segback.models.load import load
    from segback.data.tokens import encode_chat

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapter", default=None, help="adapter directory (none: stock model)")
    parser.add_argument("--data", required=True, help="cases JSONL (filtered test set)")
    args = parser.parse_args()

    model, tok = load(args.model, adapter_path=args.adapter)
    go_on = tok.encode('"},{"', add_special_tokens=False)
    if len(go_on) != 1:
        raise SystemExit(f'the tokenizer splits \'"}},{{"\' into {go_on}: no single decision token')
    ends = {ids[0] for text in ('"', '"}]}', '"}')
            if len(ids := tok.encode(text, add_special_tokens=False)) == 1}
    right = total = 0
    by_chunk: dict[str, list[int]] = {}  # "after chunk k, gold C/E" -> [right, total]
    with open(args.data) as f:
        for line in f:
            case = json.loads(line)
            prompt = encode_chat(tok, [{"role": "user", "content": build_prompt(case)}],
                                 add_generation_prompt=True)
            answer = tok.encode(gold_completion(case), add_special_tokens=False)
            logits = model(mx.array([list(prompt) + answer]))[0]
            decisions = []
            for i, t in enumerate(answer):
                if t == go_on[0] or (t in ends and i >= len(answer) - 2):
                    p = mx.softmax(logits[len(prompt) + i - 1].astype(mx.float32))
                    p_on, p_end = p[go_on[0]].item(), sum(p[e].item() for e in ends)
                    gold_on = t == go_on[0]
                    decisions.append({"gold": "C" if gold_on else "E",
                                      "p_continue": round(p_on, 3), "p_end": round(p_end, 3)})
                    hit = (p_on > p_end) == gold_on
                    right += hit
                    total += 1
                    key = f"after chunk {len(decisions)}, gold {'C' if gold_on else 'E'}"
                    by_chunk.setdefault(key, [0, 0])
                    by_chunk[key][0] += hit
                    by_chunk[key][1] += 1
            print(json.dumps({"id": case["id"], "chunks": len(case["gold"]["chunks"]),
                              "decisions": decisions}))
    print(json.dumps({"decisions": total, "right": right,
                      "right_rate": round(right / max(total, 1), 3),
                      "right_by_point": dict(sorted(by_chunk.items()))}))


if __name__ == "__main__":
    main()
