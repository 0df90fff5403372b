"""Weight-sync buckets: plan, pack/unpack bit-exactness per dtype, alignment, wire form, checksums, errors; and a
real gloo ``SyncGroup`` broadcasting packed buckets from a sender to two receivers (threads of this process)."""

from __future__ import annotations

import threading

import pytest
import torch

from weight_sync.buckets import (
    _DTYPES, ALIGN_BYTES, Bucket, bucket_checksums, buckets_from_wire, buckets_to_wire, dtype_name, pack_bucket,
    plan_buckets, tensor_checksum, to_dtype, unpack_bucket,
)
from weight_sync.group import SyncGroup, free_port


def random_tensor(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (floats include NaN/Inf/denormals), so a round trip must copy raw bytes."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# Odd sizes so that consecutive tensors would be misaligned without padding; a 0-d scalar and an empty tensor too.
SHAPES = [(3, 5), (7,), (), (2, 3, 1), (0,), (11,)]


def named_tensors():
    out = []
    for d, (name, dtype) in enumerate(sorted(_DTYPES.items())):
        for s, shape in enumerate(SHAPES):
            out.append((f"{name}.{s}", random_tensor(shape, dtype, seed=100 * d + s)))
    return out


@pytest.mark.parametrize("bucket_bytes", [1024, 10**6])
def test_round_trip_every_dtype_bit_exact(bucket_bytes):
    tensors = named_tensors()
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in tensors], bucket_bytes)
    assert (len(plan) > 1) == (bucket_bytes == 1024)
    by_name = dict(tensors)
    received = {}
    for bucket in plan:
        buf = pack_bucket(bucket, [by_name[s.name] for s in bucket.slots])
        assert buf.dtype == torch.uint8 and buf.numel() == bucket.nbytes
        wire = buf.clone()  # what a receiver gets: its own buffer
        for name, view in unpack_bucket(bucket, wire):
            received[name] = view
    assert list(received) == [n for n, _ in tensors]  # plan order preserved
    for name, t in tensors:
        assert same_bits(received[name], t), f"{name}: {t.dtype} {tuple(t.shape)} not bit-exact"


def test_offsets_aligned_and_buckets_bounded():
    entries = [(f"t{i}", (n,), torch.float16) for i, n in enumerate([1, 3, 33, 17, 100, 5, 250])]
    plan = plan_buckets(entries, 512)
    assert [b.index for b in plan] == list(range(len(plan)))
    for bucket in plan:
        end = 0
        for slot in bucket.slots:
            assert slot.offset % ALIGN_BYTES == 0
            assert slot.offset >= end  # no overlap
            assert slot.nbytes == slot.numel * 2
            end = slot.offset + slot.nbytes
        assert bucket.nbytes == end <= 512
    assert [s.name for b in plan for s in b.slots] == [e[0] for e in entries]


def test_oversize_tensor_gets_its_own_bucket():
    entries = [("small0", (4,), torch.float32), ("big", (1000,), torch.float32), ("small1", (4,), torch.float32)]
    plan = plan_buckets(entries, 1024)
    assert [[s.name for s in b.slots] for b in plan] == [["small0"], ["big"], ["small1"]]
    assert plan[1].nbytes == 4000 and plan[1].slots[0].offset == 0
    tensors = [random_tensor((1000,), torch.float32, 1)]
    assert same_bits(unpack_bucket(plan[1], pack_bucket(plan[1], tensors))[0][1], tensors[0])


def test_plan_errors():
    with pytest.raises(ValueError, match="duplicate tensor name 'w'"):
        plan_buckets([("w", (2,), torch.float32), ("v", (2,), torch.float32), ("w", (2,), torch.float32)], 1024)
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        plan_buckets([("w", (2,), torch.float32)], 0)
    with pytest.raises(ValueError, match="cannot carry dtype torch.complex64"):
        plan_buckets([("w", (2,), torch.complex64)], 1024)
    with pytest.raises(ValueError, match="unknown dtype name 'float128'"):
        to_dtype("float128")
    assert all(to_dtype(dtype_name(dt)) == dt for dt in _DTYPES.values())


def test_plan_rejects_a_negative_dimension_naming_the_tensor():
    with pytest.raises(ValueError, match=r"tensor 'layer.w': expected every dimension >= 0, got shape \(4, -1\)"):
        plan_buckets([("ok", (2,), torch.float32), ("layer.w", (4, -1), torch.float32)], 1024)
    with pytest.raises(ValueError, match="'neg'"):
        plan_buckets([("neg", (-2, -3), torch.float32)], 1024)  # a positive numel must not slip through


@pytest.mark.parametrize("bucket_bytes", [64, 1024])
def test_zero_size_tensors_never_make_a_zero_byte_bucket(bucket_bytes):
    f32 = torch.float32
    entries = [("e0", (0,), f32), ("big", (300,), f32), ("e1", (3, 0), torch.bfloat16), ("e2", (0, 7), f32),
               ("small", (5,), f32), ("big2", (300,), f32), ("e3", (0,), torch.int64)]
    plan = plan_buckets(entries, bucket_bytes)
    assert all(b.nbytes > 0 for b in plan), [b.nbytes for b in plan]
    assert [s.name for b in plan for s in b.slots] == [n for n, _, _ in entries]  # every name, in order
    for bucket in plan:
        for slot in bucket.slots:
            assert slot.offset % ALIGN_BYTES == 0 and slot.offset + slot.nbytes <= bucket.nbytes
    tensors = {n: random_tensor(shape, dt, seed=i) for i, (n, shape, dt) in enumerate(entries)}
    for bucket in plan:
        buf = pack_bucket(bucket, [tensors[s.name] for s in bucket.slots])
        for name, view in unpack_bucket(bucket, buf.clone()):
            assert same_bits(view, tensors[name]), name


def test_plan_of_only_zero_size_tensors_is_one_zero_byte_bucket():
    plan = plan_buckets([("a", (0,), torch.float32), ("b", (2, 0), torch.float16)], 1024)
    assert [(b.nbytes, [s.name for s in b.slots]) for b in plan] == [(0, ["a", "b"])]
    buf = pack_bucket(plan[0], [torch.zeros(0), torch.zeros(2, 0, dtype=torch.float16)])
    assert buf.numel() == 0
    assert [(n, tuple(t.shape), t.dtype) for n, t in unpack_bucket(plan[0], buf)] == [
        ("a", (0,), torch.float32), ("b", (2, 0), torch.float16)]
    assert plan_buckets([], 1024) == []


def test_pack_and_unpack_errors():
    bucket = plan_buckets([("a", (2, 3), torch.float32), ("b", (4,), torch.int64)], 1024)[0]
    a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="expected 2 tensors, got 1"):
        pack_bucket(bucket, [a])
    with pytest.raises(ValueError, match=r"tensor a expected shape \(2, 3\) dtype float32, got \(3, 2\)"):
        pack_bucket(bucket, [a.reshape(3, 2), b])
    with pytest.raises(ValueError, match=r"tensor b expected shape \(4,\) dtype int64, got \(4,\) torch.int32"):
        pack_bucket(bucket, [a, b.int()])
    with pytest.raises(ValueError, match="tensor a expected .* float32, got .* torch.float64"):
        pack_bucket(bucket, [a.double(), b])
    with pytest.raises(ValueError, match=f"buffer must be uint8 with >= {bucket.nbytes} bytes"):
        pack_bucket(bucket, [a, b], out=torch.zeros(bucket.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="buffer must be uint8"):
        pack_bucket(bucket, [a, b], out=torch.zeros(bucket.nbytes, dtype=torch.int8))
    with pytest.raises(ValueError, match=f"plan needs {bucket.nbytes}"):
        unpack_bucket(bucket, torch.zeros(bucket.nbytes - 1, dtype=torch.uint8))


def test_pack_into_reused_buffer_and_unpack_is_a_view():
    bucket = plan_buckets([("a", (5,), torch.float32), ("b", (3,), torch.bfloat16)], 1024)[0]
    out = torch.full((bucket.nbytes + 100,), 7, dtype=torch.uint8)
    a, b = random_tensor((5,), torch.float32, 0), random_tensor((3,), torch.bfloat16, 1)
    buf = pack_bucket(bucket, [a, b], out=out)
    assert buf.numel() == bucket.nbytes and buf.data_ptr() == out.data_ptr()
    views = dict(unpack_bucket(bucket, buf))
    assert same_bits(views["a"], a) and same_bits(views["b"], b)
    buf[bucket.slots[0].offset] ^= 0xFF  # views share the buffer's memory
    assert not same_bits(views["a"], a)


def test_wire_round_trip():
    tensors = named_tensors()
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in tensors], 2048)
    wire = buckets_to_wire(plan)
    assert all(isinstance(b, dict) for b in wire)
    import json

    back = buckets_from_wire(json.loads(json.dumps(wire)))  # survives a plain-JSON transport
    assert back == plan
    assert all(isinstance(b, Bucket) and isinstance(b.slots, tuple) for b in back)
    assert all(isinstance(s.shape, tuple) for b in back for s in b.slots)


def test_checksums_detect_a_single_flipped_bit():
    tensors = named_tensors()
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in tensors], 10**6)
    (bucket,) = plan
    by_name = dict(tensors)
    buf = pack_bucket(bucket, [by_name[s.name] for s in bucket.slots])
    sums = bucket_checksums(bucket, buf)
    assert sums == {n: tensor_checksum(t) for n, t in tensors}
    for slot in bucket.slots:
        if slot.nbytes == 0:
            continue
        flipped = buf.clone()
        flipped[slot.offset + slot.nbytes - 1] ^= 0x01  # lowest bit of the slot's last byte
        changed = {n for n, c in bucket_checksums(bucket, flipped).items() if c != sums[n]}
        assert changed == {slot.name}
    # Padding between slots is not part of any tensor: changing it changes no checksum.
    slots = bucket.slots
    gaps = [b.offset - 1 for a, b in zip(slots, slots[1:]) if b.offset > a.offset + a.nbytes]
    assert gaps
    padded = buf.clone()
    padded[gaps[0]] ^= 0xFF
    assert bucket_checksums(bucket, padded) == sums


def test_sync_group_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        SyncGroup("127.0.0.1", free_port(), 2, 2, 5.0)
    with pytest.raises(ValueError, match=r"sync backend must be one of \('gloo', 'nccl', 'store'\), got 'mpi'"):
        SyncGroup("127.0.0.1", free_port(), 0, 1, 5.0, backend="mpi")


def test_sync_group_broadcasts_packed_buckets_over_gloo():
    """Sender (rank 0) streams buckets with async broadcasts and double buffering, like the train worker; two
    receivers know only the wire plan and end with bit-identical tensors and equal checksums."""
    tensors = named_tensors()
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in tensors], 1024)
    assert len(plan) >= 3
    broadcast_and_check(tensors, plan)


def test_sync_group_broadcasts_a_plan_of_only_zero_size_tensors():
    """The one 0-byte bucket of such a plan is broadcast like any other and every name arrives."""
    tensors = [("empty.a", torch.zeros(0, 3)), ("empty.b", torch.zeros(2, 0, dtype=torch.bfloat16))]
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in tensors], 1024)
    assert [b.nbytes for b in plan] == [0]
    broadcast_and_check(tensors, plan)


def broadcast_and_check(tensors: list[tuple[str, torch.Tensor]], plan: list[Bucket]) -> None:
    world, timeout_s = 3, 30.0
    wire = buckets_to_wire(plan)
    port = free_port()
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def sender():
        group = SyncGroup("127.0.0.1", port, 0, world, timeout_s)
        by_name = dict(tensors)
        sums, pending, buffers = {}, None, [torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8)
                                            for _ in range(2)]
        for i, bucket in enumerate(plan):
            # buffers[i % 2] last carried bucket i - 2, whose broadcast was waited for before bucket i - 1 was sent.
            buf = pack_bucket(bucket, [by_name[s.name] for s in bucket.slots], out=buffers[i % 2])
            sums.update(bucket_checksums(bucket, buf))
            if pending is not None:
                pending.wait()
            pending = group.broadcast(buf, async_op=True)
        pending.wait()
        results[0] = {"checksums": sums}

    def receiver(rank: int):
        group = SyncGroup("127.0.0.1", port, rank, world, timeout_s)
        sums, got = {}, {}
        for bucket in buckets_from_wire(wire):
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
            assert group.broadcast(buf).wait()
            sums.update(bucket_checksums(bucket, buf))
            got.update({n: t.clone() for n, t in unpack_bucket(bucket, buf)})
        results[rank] = {"checksums": sums, "tensors": got}

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(sender,))]
    threads += [threading.Thread(target=guarded, args=(receiver, r)) for r in range(1, world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "sync group hung"
    assert not errors, errors
    expected = {n: tensor_checksum(t) for n, t in tensors}
    assert results[0]["checksums"] == expected
    for rank in range(1, world):
        assert results[rank]["checksums"] == expected
        for name, t in tensors:
            assert same_bits(results[rank]["tensors"][name], t), f"rank {rank}: {name} differs"
