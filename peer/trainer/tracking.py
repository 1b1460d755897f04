"""A trainer's curves for TensorBoard and Weights & Biases: loss, learning rate, samples/s, validation
and swarm size. Both are optional extras (`pip install -e ".[tensorboard]"`, `".[wandb]"`); asked for
without the package, the trainer refuses to start and says what to install. W&B honours its own
environment (WANDB_MODE=offline logs with no network, to sync later).

The x axis of every curve is the samples this trainer completed; the run's step is a curve of its own.
"""

from __future__ import annotations

import logging

from dht.errors import UserError

logger = logging.getLogger(__name__)


class Tracker:
    def __init__(self, tensorboard: str = "", wandb_project: str = "", name: str = "", config: dict | None = None):
        self._writer = self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # lazy: an optional extra
            except ImportError:
                raise UserError(
                    '--tensorboard needs the tensorboard package: pip install -e ".[tensorboard]"'
                ) from None
            self._writer = SummaryWriter(log_dir=tensorboard)
        if wandb_project:
            try:
                import wandb  # lazy: an optional extra
            except ImportError:
                raise UserError('--wandb needs the wandb package: pip install -e ".[wandb]"') from None
            self._wandb = wandb.init(project=wandb_project, name=name or None, config=config or {}, reinit=True)

    @property
    def active(self) -> bool:
        return self._writer is not None or self._wandb is not None

    def log(self, step: int, values: dict[str, float | None]) -> None:
        """Values by name ("train/loss", "val/bits_per_byte", ...) at x = `step`; None values are left out."""
        values = {k: float(v) for k, v in values.items() if v is not None}
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
