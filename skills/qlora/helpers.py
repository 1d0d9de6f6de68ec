"""What the qlora skill writes into a recipe: skills/qlora/codemod.py copies these definitions
with libcst (skills/codemod_kit/copied.py). A real module, so that ruff lints it and tests import
it. The adapters themselves are the lora skill's ``apply_lora``, applied after this.
"""

import ctypes
import mmap

import torch
from bitsandbytes.nn import Linear4bit, Params4bit

from engine.blocks import find_blocks  # written by ensure_find_blocks

QUANT_STORAGE_DTYPES = {"uint8": torch.uint8, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def quantize_4bit(
    model: torch.nn.Module,
    quant_type: str = "nf4",
    double_quant: bool = True,
    compute_dtype: str | None = None,
    quant_storage: str = "uint8",
) -> int:
    """QLoRA's base model (Dettmers et al., 2023): every ``nn.Linear`` inside the model's
    repeated blocks becomes a frozen bitsandbytes ``Linear4bit`` holding its weight in 4 bits
    (``nf4``: NormalFloat, or ``fp4``), quantised where the weight is (CPU or GPU). With
    ``double_quant`` the per-block scales are quantised too (about 0.4 bits per weight less).
    The layers compute in ``compute_dtype`` (default: the weight's own dtype). ``quant_storage``
    is the dtype the packed bytes are stored as (under FSDP2: uint8, or the run's param_dtype).
    Embeddings, norms and the output head stay as they
    are. Returns the number of layers quantised. (Written by the qlora skill.)
    """
    where, blocks = find_blocks(model, "qlora", warn=lambda message: None)
    if quant_storage not in QUANT_STORAGE_DTYPES:
        raise ValueError(f"qlora: quant_storage={quant_storage!r}; choose one of {sorted(QUANT_STORAGE_DTYPES)}")
    storage = QUANT_STORAGE_DTYPES[quant_storage]
    mapped = mapped_weight_files()
    count = 0
    for block in blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                weight = child.weight
                compute = getattr(torch, compute_dtype) if compute_dtype else weight.dtype
                layer = Linear4bit(
                    child.in_features, child.out_features, bias=child.bias is not None,
                    compute_dtype=compute, compress_statistics=double_quant,
                    quant_type=quant_type, quant_storage=storage, device="meta",
                )
                layer.weight = Params4bit(
                    weight.detach().to(compute), requires_grad=False, compress_statistics=double_quant,
                    quant_type=quant_type, quant_storage=storage,
                ).to(weight.device)  # quantised on the weight's device
                # bitsandbytes repacks a weight in place for CPU inference (eval mode, no grad)
                # when the CPU has AVX512-BF16, and only for widths its block divides (688 is
                # not): one layout for training, evaluation, sampling and export.
                layer.support_avx512bf16_for_cpu = False
                if child.bias is not None:
                    layer.bias = torch.nn.Parameter(child.bias.detach().clone(), requires_grad=False)
                setattr(parent, name, layer)
                drop_file_pages(weight, mapped)  # its 4-bit copy replaces it: the file's pages need not stay
                count += 1
    if not count:
        raise ValueError(
            f"qlora: no nn.Linear layer inside the repeated blocks of {type(model).__name__} "
            f"({where or 'none found'}) to quantise"
        )
    kept = sum(p.numel() for p in model.parameters() if not isinstance(p, Params4bit))
    print(
        f"qlora: quantised {count} linear layers of {type(model).__name__} to 4-bit {quant_type}"
        f"{' with double quantisation' if double_quant else ''}; {kept:,} values kept unquantised",
        flush=True,
    )
    return count


MADV_DONTNEED = 4  # madvise(2)


def mapped_weight_files() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of ``.safetensors`` files (``from_pretrained``
    on a CPU maps the file and its parameters are views of it); none where there is no
    ``/proc/self/maps``."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                    start, end = (int(address, 16) for address in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        pass
    return ranges


def drop_file_pages(weight: torch.Tensor, mapped: list[tuple[int, int]]) -> None:
    """Give back the resident pages of a weight that is a view of a mapped weights file, once
    quantised: reading it to quantise made the file's pages resident, counted in the process's
    memory at their full precision for as long as the mapping lives (the unquantised parameters
    beside it keep it). Only whole pages inside the weight's bytes, and only of a file's mapping
    (read again from the file if touched; anonymous memory would be zeroed, so it is left alone)."""
    if weight.device.type != "cpu" or not mapped:
        return
    start = weight.data_ptr()
    end = start + weight.numel() * weight.element_size()
    if not any(low <= start and end <= high for low, high in mapped):
        return
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)
