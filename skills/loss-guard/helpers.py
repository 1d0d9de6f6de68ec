"""What the loss-guard skill writes into a recipe: skills/loss-guard/codemod.py copies these
definitions with libcst (skills/codemod_kit/copied.py). A real module, so that ruff lints it and
tests import it.
"""

import math


class LossGuard:
    """Skip optimizer steps that would damage the model, and stop a run that keeps making them.

    A step is bad when its loss or gradient norm is not finite, or when its loss is a spike:
    above ``spike_factor`` times the running mean of recent good losses (judged after
    ``warmup_steps`` good steps). A bad step is skipped: the optimizer does not step, so the
    parameters stay as they were, and training goes on with the next batch. ``max_bad_steps`` bad
    steps in a row raise an error: by then the cause is not one bad batch. The guard decides
    from the global loss and norm, so every rank decides the same. (Written by the loss-guard
    skill.)
    """

    def __init__(self, max_bad_steps: int = 5, spike_factor: float | None = 3.0, warmup_steps: int = 10):
        self.max_bad_steps = max_bad_steps
        self.spike_factor = spike_factor
        self.warmup_steps = warmup_steps
        self.mean_loss: float | None = None
        self.good_steps = 0
        self.bad_in_a_row = 0
        self.skipped = 0

    def check(self, loss, grad_norm=None) -> bool:
        """True when the optimizer may step."""
        # detach(): float() of a tensor that requires grad warns on every step in a plain script.
        loss = float(loss.detach() if hasattr(loss, "detach") else loss)
        if grad_norm is not None and hasattr(grad_norm, "detach"):
            grad_norm = grad_norm.detach()
        norm = float(grad_norm) if grad_norm is not None else 0.0
        problem = None
        if not math.isfinite(loss):
            problem = f"loss is {loss}"
        elif not math.isfinite(norm):
            problem = f"gradient norm is {norm}"
        elif (
            self.spike_factor is not None
            and self.good_steps >= self.warmup_steps
            and loss > self.spike_factor * self.mean_loss
        ):
            problem = f"loss {loss:.4g} is over {self.spike_factor} x the running mean {self.mean_loss:.4g}"
        if problem is None:
            self.good_steps += 1
            self.bad_in_a_row = 0
            self.mean_loss = loss if self.mean_loss is None else 0.9 * self.mean_loss + 0.1 * loss
            return True
        self.bad_in_a_row += 1
        self.skipped += 1
        print(f"loss-guard: skipped an optimizer step: {problem} ({self.bad_in_a_row} in a row)", flush=True)
        if self.bad_in_a_row >= self.max_bad_steps:
            raise RuntimeError(
                f"loss-guard: {self.bad_in_a_row} bad steps in a row (last: {problem}); stopping. "
                "Lower the learning rate, check the data, or resume from an earlier checkpoint"
            )
        return False


def unscale_once(scaler, optimizer) -> None:
    """Record the inf checks that GradScaler.update() needs when loss-guard skips scaler.step
    (unscale_ may have run already, for gradient clipping). (Written by the loss-guard skill.)"""
    try:
        scaler.unscale_(optimizer)
    except RuntimeError:  # unscale_() was already called this iteration
        pass
