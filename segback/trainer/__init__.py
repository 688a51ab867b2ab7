"""`segback train`: LoRA, DoRA and full fine-tuning with the segmented backward, mlx-lm's options.

- `config`: every option declared once (`TrainConfig`); the command line (`arguments`) and
  config files (`config_file`) come from it, its values are checked in `values`, its engine
  options typed once in `engine_request`;
- `loop`: the training loop (`train(model, optimizer, train_set, val_set, args, grad_fn)`);
- `checkpoints`: the run directory (checkpoints, log, bit-exact resume, final adapter);
- `cli`: options -> model, plan, optimizer, data -> loop (`segback train`).
"""

from segback.trainer.checkpoints import ResumeError, TrainingDiverged
from segback.trainer.config import TrainConfigError, TrainConfig
from segback.trainer.loop import evaluate, segmented_grad_fn, train

__all__ = ["TrainConfigError", "ResumeError", "TrainConfig", "TrainingDiverged", "evaluate",
           "segmented_grad_fn", "train"]
