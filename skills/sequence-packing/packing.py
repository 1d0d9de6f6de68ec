"""The packing the sequence-packing skill writes into a recipe: first-fit-decreasing bins, and
for each kind of recipe a ``pack_*``/``collate_*`` pair the codemod copies as ``pack_pieces`` and
``collate_packed`` (skills/sequence-packing/codemod.py, with libcst: ``seq_len``, ``pad_id`` and
``IGNORE`` become the recipe's own names). A real module: ruff lints it, and
tests/skills/test_skill_modules.py runs it.
"""

import torch

IGNORE = -100  # the label the loss ignores; the recipe's IGNORE_INDEX where it has one


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bin packing: the indices of ``lengths`` grouped into bins that hold at most ``capacity``.
    Longest first, each item goes into the first bin with room for it (first-fit decreasing
    needs at most 11/9 of the optimal number of bins, plus one). A max-tree over the bins'
    free room finds that bin in O(log n). (Written by the sequence-packing skill.)
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    room = [capacity] * (2 * size)  # leaves: free room of bin i (unopened bins are empty)
    bins: list[list[int]] = []
    for item in order:
        need = lengths[item]
        if need > capacity:
            raise ValueError(f"a sequence of {need} positions does not fit in rows of {capacity}")
        node = 1
        while node < size:  # down to the leftmost bin with enough room
            node = 2 * node if room[2 * node] >= need else 2 * node + 1
        if node - size == len(bins):
            bins.append([])
        bins[node - size].append(item)
        room[node] -= need
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


# The recipe computes the next-token loss itself: a piece of n tokens gives n - 1 (input, label)
# pairs. (The template's convention.)
def pack_pairs(pieces: list[torch.Tensor], seq_len: int) -> list[tuple[torch.Tensor, ...]]:
    """Sequence packing: group pieces into rows of at most ``seq_len`` positions with
    first-fit decreasing, so that rows carry more documents and less padding. A piece of n
    tokens fills n - 1 positions (inputs with their next-token labels). Each row is a tuple of
    pieces, laid out by ``collate_packed``. A piece may also be a 2 × n tensor: its tokens,
    and the targets the loss looks at (ignored elsewhere, e.g. an SFT prompt).
    (Written by the sequence-packing skill.)
    """
    bins = first_fit_decreasing([torch.as_tensor(piece).shape[-1] - 1 for piece in pieces], seq_len)
    return [tuple(pieces[i] for i in sorted(members)) for members in bins]


def collate_pairs(rows: list, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Lay out packed rows (tuples of pieces; a lone piece is a row of its own): inputs and
    next-token labels piece after piece, padding at the end, and position ids that restart at 0
    for each piece. With ``attention_mask=None``, transformers turns restarting position ids
    into a block-diagonal causal mask, so a token attends only to its own piece and each
    piece's loss is what it would be alone. (Written by the sequence-packing skill.)
    """
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), seq_len), IGNORE, dtype=torch.int64)
    position_ids = torch.zeros((len(rows), seq_len), dtype=torch.int64)
    for row, pieces in enumerate(rows):
        start = 0
        for piece in pieces if isinstance(pieces, tuple) else (pieces,):
            piece = torch.as_tensor(piece)
            tokens, targets = (piece[0], piece[1]) if piece.dim() == 2 else (piece, piece)
            n = len(tokens) - 1
            input_ids[row, start : start + n] = tokens[:-1]
            labels[row, start : start + n] = targets[1:]
            position_ids[row, start : start + n] = torch.arange(n)
            start += n
        position_ids[row, start:] = torch.arange(seq_len - start)  # the padding: a sequence of its own
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


# Image+text samples: a piece is ``(tokens_and_targets, pixel_values)``, laid out as the pairs
# are; the pictures of a batch go in the order of their image tokens (row after row, piece after
# piece), which is the order a LLaVA-style model puts their features in. A row is a list (a lone
# piece is a tuple).
def pack_images(pieces: list[tuple[torch.Tensor, torch.Tensor]], seq_len: int) -> list[list[tuple]]:
    """Sequence packing of image+text samples: group ``(tokens_and_targets, pixel_values)`` pieces
    into rows of at most ``seq_len`` positions with first-fit decreasing, so that rows carry more
    samples and less padding. A piece of n tokens (its image tokens included) fills n - 1
    positions. Each row is a list of pieces, laid out by ``collate_packed``. (Written by the
    sequence-packing skill.)
    """
    bins = first_fit_decreasing([piece[0].shape[-1] - 1 for piece in pieces], seq_len)
    return [[pieces[i] for i in sorted(members)] for members in bins]


def collate_images(rows: list, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Lay out packed rows (lists of ``(tokens_and_targets, pixel_values)`` pieces; a lone piece
    is a row of its own): inputs and next-token labels piece after piece, padding at the end,
    position ids that restart at 0 for each piece, and the pictures in the order of their image
    tokens (row after row, piece after piece), the order in which the model fills its image
    tokens. With ``attention_mask=None``, transformers turns restarting position ids into a
    block-diagonal causal mask, so each sample's loss is what it would be alone. (Written by the
    sequence-packing skill.)
    """
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), seq_len), IGNORE, dtype=torch.int64)
    position_ids = torch.zeros((len(rows), seq_len), dtype=torch.int64)
    pictures = []
    for row, pieces in enumerate(rows):
        start = 0
        for tokens, picture in pieces if isinstance(pieces, list) else (pieces,):
            n = tokens.shape[-1] - 1
            input_ids[row, start : start + n] = tokens[0, :-1]
            labels[row, start : start + n] = tokens[1, 1:]
            position_ids[row, start : start + n] = torch.arange(n)
            pictures.append(picture)
            start += n
        position_ids[row, start:] = torch.arange(seq_len - start)  # the padding: a sequence of its own
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "pixel_values": torch.stack(pictures),
    }


# The model shifts the labels itself (Hugging Face ``labels=``): a document of n tokens fills n
# positions and its labels are its tokens.
def pack_tokens(documents: list, seq_len: int) -> list[tuple]:
    """Sequence packing: group documents into rows of at most ``seq_len`` tokens with
    first-fit decreasing, so that rows carry more documents and less padding (a longer document
    is cut to ``seq_len``, as unpacked batches cut it). Each row is a tuple of documents, laid
    out by ``collate_packed``. (Written by the sequence-packing skill.)
    """
    bins = first_fit_decreasing([min(len(document), seq_len) for document in documents], seq_len)
    return [tuple(documents[i] for i in sorted(members)) for members in bins]


def collate_tokens(rows: list, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Lay out packed rows (tuples of documents; a lone document is a row of its own): documents
    one after the other, padding at the end, and position ids that restart at 0 for each
    document. With ``attention_mask=None``, transformers turns restarting position ids into a
    block-diagonal causal mask, so a token attends only to its own document. The model shifts
    the labels, so each document's first label is ignored: nothing in its document comes
    before it. Each document's loss is what it would be alone. (Written by the sequence-packing
    skill.)
    """
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), seq_len), IGNORE, dtype=torch.int64)
    position_ids = torch.zeros((len(rows), seq_len), dtype=torch.int64)
    for row, documents in enumerate(rows):
        start = 0
        for document in documents if isinstance(documents, tuple) else (documents,):
            tokens = torch.as_tensor(document[:seq_len], dtype=torch.int64)
            n = len(tokens)
            input_ids[row, start : start + n] = tokens
            labels[row, start + 1 : start + n] = tokens[1:]
            position_ids[row, start : start + n] = torch.arange(n)
            start += n
        position_ids[row, start:] = torch.arange(seq_len - start)  # the padding: a sequence of its own
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
