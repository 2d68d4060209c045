"""Hand-worked examples of docs/resolver-contract.md (top_k=4, hot_rows=8, block_size=4)."""

from __future__ import annotations

import torch
from refcpu_support import bound_runtime, bytes_of, i32, inputs, small_config

from hisparse_core.geometry import BF16_MLA

SOURCE = [[5, 6, -1, 7], [1, 2, 3, 4]]
RESIDENT = [[-1, 2, -1, -1], [-1, -1, -1, -1]]
HOT = [[10, 11], [12, 13]]


def test_first_step_fills_oldest_slots_in_first_reference_order() -> None:
    rt, host, dev = bound_runtime(small_config(), host_blocks=8, device_blocks=16)
    # 0 -> host row 20; 5 -> resident block 2 row 9; 9 -> null page; 13 -> host row 29.
    res = rt.resolve(inputs([[0, 5, 9, 13]], [0], [16], SOURCE, RESIDENT, HOT))
    assert res.rows.tolist() == [[40, 9, -1, 41], [-1] * 4, [-1] * 4]
    assert res.valid_counts.tolist() == [3, 0, 0]
    assert res.plan_host.tolist() == [[20, 29, -1, -1], [-1] * 4, [-1] * 4]
    assert res.plan_device.tolist() == [[40, 41, -1, -1], [-1] * 4, [-1] * 4]
    assert res.plan_counts.tolist() == [2, 0, 0]
    hot_map, lru = rt.hot_state(0)
    assert hot_map.tolist() == [20, 29, -1, -1, -1, -1, -1, -1]
    assert lru.tolist() == [2, 3, 4, 5, 6, 7, 0, 1]
    s = rt.stats()
    assert (s.resident, s.hits, s.misses, s.h2d_bytes, s.d2h_bytes) == (1, 0, 2, 2 * 656, 0)
    flat = dev[0].view(-1, 656)
    assert torch.equal(flat[40], host[0][20]) and torch.equal(flat[41], host[0][29])
    # State row 1 was not in the batch.
    assert rt.hot_state(1)[0].tolist() == [-1] * 8 and rt.hot_state(1)[1].tolist() == list(range(8))


def test_second_step_hits_keep_slots_and_move_to_the_back() -> None:
    rt, _, _ = bound_runtime(small_config(), host_blocks=8, device_blocks=16)
    rt.resolve(inputs([[0, 5, 9, 13]], [0], [16], SOURCE, RESIDENT, HOT))
    # 13 -> 29 (hit in slot 1); 1 -> 21 and 2 -> 22 miss and take slots 2 and 3 (slot 0, holding 20,
    # is evictable but slots 2 and 3 are older).
    res = rt.resolve(inputs([[13, 1, 2, -1]], [0], [16], SOURCE, RESIDENT, HOT))
    assert res.rows[0].tolist() == [41, 42, 43, -1]
    assert res.plan_host[0].tolist() == [21, 22, -1, -1]
    assert res.plan_device[0].tolist() == [42, 43, -1, -1]
    hot_map, lru = rt.hot_state(0)
    assert hot_map.tolist() == [20, 29, 21, 22, -1, -1, -1, -1]
    assert lru.tolist() == [4, 5, 6, 7, 0, 2, 3, 1]
    s = rt.stats()
    assert (s.resident, s.hits, s.misses) == (1, 1, 4)


def test_speculative_group_resolves_the_union_and_padding_rows_are_blank() -> None:
    cfg = small_config(rows_per_request=2)
    rt, _, _ = bound_runtime(cfg, host_blocks=8, device_blocks=16)
    # Prime state row 1: hot_map = [4, 5, 6, 7, 8, 9, 10, 11] (host blocks 1 and 2), lru 0..7 rotated.
    rt.resolve(inputs([[0, 1, 2, 3], [4, 5, 6, 7]], [1, 1], [16, 16], SOURCE, RESIDENT, HOT))
    assert rt.hot_state(1)[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert rt.hot_state(1)[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    # Row 0 refs host rows 13 (page 2 -> block 3), 4 (hit), 13 again.
    # Row 1 refs 8 (hit), 12 (page 2 -> block 3), 4 (hit, shared with row 0). Row 2 is padding.
    res = rt.resolve(inputs([[9, 0, 9, -1], [4, 8, 0, -1], [3, 3, 3, 3]], [1, 1, -1], [16, 16, 0],
                            SOURCE, RESIDENT, HOT))
    # U = [13, 4, 8, 12]; hit slots (LRU order): 0 (row 4), 4 (row 8); evictable: 1 2 3 5 6 7.
    # Misses 13 -> slot 1, 12 -> slot 2. New LRU: 3 5 6 7 | 1 2 | 0 4.
    hot_map, lru = rt.hot_state(1)
    assert hot_map.tolist() == [4, 13, 12, 7, 8, 9, 10, 11]
    assert lru.tolist() == [3, 5, 6, 7, 1, 2, 0, 4]
    # hot_table[1] = [12, 13]: slot s -> 12*4 + s for s < 4.
    assert res.rows.tolist() == [[49, 48, 49, -1], [52, 50, 48, -1], [-1] * 4]
    assert res.valid_counts.tolist() == [3, 3, 0]
    assert res.plan_host.tolist() == [[13, -1, -1, -1], [12, -1, -1, -1], [-1] * 4]
    assert res.plan_device.tolist() == [[49, -1, -1, -1], [50, -1, -1, -1], [-1] * 4]
    assert res.plan_counts.tolist() == [1, 1, 0]


def test_resident_only_batch_leaves_hot_state_untouched() -> None:
    rt, _, _ = bound_runtime(small_config(), host_blocks=8, device_blocks=16)
    rt.resolve(inputs([[0, 13, -1, -1]], [0], [16], SOURCE, RESIDENT, HOT))
    before = rt.hot_state(0)
    res = rt.resolve(inputs([[4, 5, 6, 7]], [0], [16], SOURCE, RESIDENT, HOT))
    assert res.rows[0].tolist() == [8, 9, 10, 11]
    assert res.plan_counts.tolist() == [0, 0, 0]
    after = rt.hot_state(0)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_bf16_rows_are_copied_bit_for_bit_by_gather_and_replay() -> None:
    cfg = small_config(row_format=BF16_MLA, num_layers=3)
    rt, host, dev = bound_runtime(cfg, host_blocks=8, device_blocks=16, seed=7)
    res = rt.resolve(inputs([[0, 13, -1, 2]], [0], [16], SOURCE, RESIDENT, HOT))
    assert res.plan_host[0].tolist() == [20, 29, 22, -1]
    for layer in (1, 2):
        assert not torch.equal(bytes_of(dev[layer].view(-1, 576)[40]), bytes_of(host[layer][20]))
    rt.replay_plan()
    for layer in range(3):
        flat = dev[layer].view(-1, 576)
        for h, d in zip(res.plan_host[0, :3].tolist(), res.plan_device[0, :3].tolist(), strict=False):
            assert torch.equal(bytes_of(flat[d]), bytes_of(host[layer][h]))
    assert rt.stats().h2d_bytes == 3 * 3 * 1152


def test_invalidations_clear_slots_and_keep_lru() -> None:
    rt, _, _ = bound_runtime(small_config(), host_blocks=8, device_blocks=16)
    rt.resolve(inputs([[0, 1, 13, 14]], [0], [16], SOURCE, RESIDENT, HOT))
    _, lru = rt.hot_state(0)
    rt.invalidate_written_slots(i32([0, -1, 0]), i32([1 + 20, 29, 31]))
    assert rt.hot_state(0)[0].tolist() == [20, -1, 29, 30, -1, -1, -1, -1]
    rt.invalidate_host_blocks([7])
    assert rt.hot_state(0)[0].tolist() == [20, -1, -1, -1, -1, -1, -1, -1]
    assert torch.equal(rt.hot_state(0)[1], lru)
    rt.reset_state([0])
    assert rt.hot_state(0)[0].tolist() == [-1] * 8 and rt.hot_state(0)[1].tolist() == list(range(8))
