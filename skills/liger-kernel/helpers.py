"""What the liger-kernel skill writes into a recipe: skills/liger-kernel/codemod.py copies these definitions
with libcst (skills/codemod_kit/copied.py). A real module, so that ruff lints it and tests import it.
"""

import importlib.util
import inspect

import torch
from typing import Callable


def apply_liger_kernels(
    model: torch.nn.Module,
    rope: bool = True,
    swiglu: bool = True,
    rms_norm: bool = True,
    fused_linear_cross_entropy: bool = True,
    warn: Callable[[str], None] | None = None,
) -> bool:
    """Liger's Triton kernels for the model's family (``model.config.model_type``: Llama,
    Mistral, Qwen, Gemma, ...), patched into the model in place: fused RMSNorm, SwiGLU MLP and
    rotary embeddings, and with ``fused_linear_cross_entropy`` a forward that, in training,
    computes the loss from the last hidden states and the output head's weight chunk by chunk
    without materialising the logits (it then takes ``labels=`` or ``shift_labels=`` and returns
    ``.loss``). Call it on the plain model, before LoRA, tensor parallelism and FSDP2 wrap it.
    Needs a CUDA GPU and the liger-kernel package; without them the model is left as it is and
    ``warn`` says so once. Returns whether the fused loss is on. (Written by the liger-kernel skill.)
    """
    warn = warn or (lambda message: print(f"warning: {message}", flush=True))
    unchanged = "training continues with the model's own modules"
    if not torch.cuda.is_available():
        warn(f"liger-kernel: no CUDA GPU, so Liger's Triton kernels are off; {unchanged}")
        return False
    if importlib.util.find_spec("liger_kernel") is None:
        warn(f"liger-kernel: the liger_kernel package is not installed (pip install liger-kernel); {unchanged}")
        return False
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        warn(f"liger-kernel: Liger has no kernels for model type {model_type!r}; {unchanged}")
        return False
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]  # Liger's public apply_liger_kernel_to_<type>
    options = {"rope": rope, "swiglu": swiglu, "rms_norm": rms_norm, "cross_entropy": False,
               "fused_linear_cross_entropy": fused_linear_cross_entropy}
    accepted = inspect.signature(apply).parameters  # each model type takes its own subset
    apply(model=model, **{name: value for name, value in options.items() if name in accepted})
    return fused_linear_cross_entropy
