"""Packing without leaks: windows of whole documents, positions restarting per document, no
attention across documents; a packed window's loss is the token-weighted mean of its
documents' losses computed alone (issue 19, point 4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parallel3d.data.batch import IGNORE_INDEX
from parallel3d.data.format import open_dataset
from parallel3d.data.packing import PackedWindows, whole_document_spans
from parallel3d.models.llama import Llama, config_from_preset

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 96


def test_whole_document_spans_worked_example():
    # documents [0,5) [5,7) [7,20) [20,24); windows of S + 1 = 8 tokens
    spans = whole_document_spans(np.array([0, 5, 7, 20]), 24, 7).tolist()
    # [0,7): the first two whole; the 13-token document is cut, its pieces overlapping by
    # the one token that is the first piece's last target and the next piece's first input;
    # its rest [14,20) fits with nothing else ([20,24) would not: 10 > 8)
    assert spans == [[0, 7], [7, 8], [14, 6], [20, 4]]


def test_window_layout_by_hand():
    tokens = np.arange(100, 124)  # ids = 100 + stream position
    w = PackedWindows(tokens, 7, starts=np.array([0, 5, 7, 20]), whole=True, pad_id=0)
    ids, targets, positions = w.sample(0)  # documents [0,5) and [5,7), one padding token
    assert ids.tolist() == [100, 101, 102, 103, 104, 105, 106, 0]
    assert positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    # the target at input 4 is document 2's first token, at input 6 the padding: not trained
    assert targets.tolist() == [101, 102, 103, 104, IGNORE_INDEX, 106, IGNORE_INDEX]
    ids, targets, positions = w.sample(2)  # [14,20): the rest of a cut document, then padding
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 0]
    assert targets.tolist() == [115, 116, 117, 118, 119, IGNORE_INDEX, IGNORE_INDEX]
    assert w.supervised([0, 1, 2, 3]) == 5 + 7 + 5 + 3


def _pieces(starts: np.ndarray, start: int, length: int) -> list[tuple[int, int]]:
    """The documents (or pieces of one) inside the span, found here from the starts."""
    cuts = sorted({start, start + length, *[int(s) for s in starts if start < s < start + length]})
    return list(zip(cuts[:-1], cuts[1:]))


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """prepare-data on 300 JSON-line documents of 3 to 60 words (several per window)."""
    import random

    from chat_inputs import WORDS, write_jsonl
    from data_inputs import make_tokenizer
    from parallel3d.data.prepare import prepare_data

    root = tmp_path_factory.mktemp("short")
    rng = random.Random(0)
    docs = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))} for _ in range(300)]
    write_jsonl(root / "in" / "docs.jsonl", docs)
    prepare_data([str(root / "in")], make_tokenizer(root / "tok"), root / "data", workers=1,
                 progress=False)
    return root / "data"


@pytest.mark.parametrize("packing", ["whole", "documents"])
def test_packed_window_loss_is_the_token_weighted_mean_of_its_documents(short_docs, packing):
    ds = open_dataset(short_docs)
    tokens, starts = ds.split("train"), ds.document_starts("train")
    windows = PackedWindows(tokens, SEQ, starts=starts, whole=packing == "whole",
                            pad_id=ds.eos_id)
    torch.manual_seed(0)
    model = Llama(config_from_preset("debug", vocab_size=768, n_layers=2, dim=64, n_heads=4,
                                     n_kv_heads=2, ffn_dim=160, init_std=0.3)).eval()
    checked = 0
    for i in range(windows.num_samples):
        start, length = windows.span(i)
        pieces = _pieces(starts, start, length)
        if len(pieces) < 3:
            continue
        ids, targets, positions = windows.sample(i)
        with torch.no_grad():
            logits = model(torch.from_numpy(ids[None, :-1]), positions=torch.from_numpy(positions[None]))
            packed = F.cross_entropy(logits[0].double(), torch.from_numpy(targets),
                                     ignore_index=IGNORE_INDEX, reduction="sum")
            leaky = F.cross_entropy(model(torch.from_numpy(ids[None, :-1]))[0].double(),
                                    torch.from_numpy(targets), ignore_index=IGNORE_INDEX, reduction="sum")
            total, count = 0.0, 0
            for a, b in pieces:  # each alone: positions 0.., nothing else to attend to
                piece = torch.from_numpy(np.asarray(tokens[a:b], dtype=np.int64))
                alone = model(piece[None, :-1])[0].double()
                want = piece[1:]  # a piece's first token is no target: a document start, or input 0
                total += float(F.cross_entropy(alone, want, reduction="sum"))
                count += len(want)
        assert count == int((torch.from_numpy(targets) != IGNORE_INDEX).sum())
        # fp32 logits summed in float64: masked SDPA over the window vs plain causal SDPA
        # over each piece, the same products in another order
        assert abs(float(packed) / count - total / count) < 1e-5 * total / count, (i, packed, total)
        # attending across documents (with positions 0..S-1) would have changed it by more
        # than 10x that bound: the check can fail (init_std 0.3 so that a random model's
        # outputs depend on what it attends to)
        assert abs(float(leaky) - total) > 1e-4 * total
        checked += 1
        if checked == 3:
            break
    assert checked == 3
