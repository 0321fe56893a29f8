"""The synthetic tasks grade exactly the tokens their definitions say."""

from __future__ import annotations

import torch

from sharp.models.tasks import IGNORE, KV, QUERY, READ, SEP, WRITE, TextData, copy_batch, flip_flop_batch, mqmtar_batch


def test_copy_grades_the_copied_symbols():
    b = copy_batch(4, 7, torch.Generator().manual_seed(0))
    graded = b.targets != IGNORE
    assert graded.sum(1).tolist() == [7] * 4
    src = b.input_ids[:, 1:8]
    assert (b.targets[graded].view(4, 7) == src).all()
    assert (b.input_ids[:, 8] == SEP).all()


def test_flip_flop_reads_return_the_last_written_bit():
    b = flip_flop_batch(16, 40, torch.Generator().manual_seed(1))
    seq = torch.cat((b.input_ids, b.targets.clamp_min(0)[:, -1:]), 1)
    for row, targets in zip(b.input_ids.tolist(), b.targets.tolist(), strict=True):
        last = None
        for t in range(1, len(row) - 1, 2):
            instr, bit = row[t], row[t + 1]
            if instr == WRITE:
                last = bit
            if instr == READ:
                assert targets[t] == last == bit  # the target after a read is the bit that follows it
            else:
                assert targets[t] == IGNORE
    assert seq.shape[1] == 81


def test_mqmtar_grades_the_values_of_queried_keys():
    b = mqmtar_batch(3, 6, torch.Generator().manual_seed(2), queries=2)
    for row, targets in zip(b.input_ids.tolist(), b.targets.tolist(), strict=True):
        pairs = {tuple(row[1 + 5 * i : 3 + 5 * i]): tuple(row[4 + 5 * i : 6 + 5 * i]) for i in range(6)}
        assert all(row[3 + 5 * i] == KV for i in range(6))
        start = 1 + 5 * 6
        for j in range(2):
            q = row[start + 6 * j : start + 6 * j + 6]
            assert q[0] == QUERY and q[3] == KV
            # targets are next tokens: value tokens sit at q positions 4, 5 and are predicted from 3, 4
            assert tuple(targets[start + 6 * j + 3 : start + 6 * j + 5]) == pairs[(q[1], q[2])]
        assert sum(t != IGNORE for t in targets) == 4


def test_text_windows(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 20)
    data = TextData(path)
    b = data.batch(2, 16, torch.Generator().manual_seed(0))
    assert b.input_ids.shape == (2, 16) and (b.targets[:, :-1] == b.input_ids[:, 1:]).all()
