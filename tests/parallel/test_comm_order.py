"""The NCCL-order replay on hand-written traces: each rule on its own, and the reports it gives."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sppo.parallel.comm_order import (
    Call,
    Comm,
    CommunicationHang,
    CommunicationMismatch,
    Message,
    Wait,
    replay,
)

PAIR = Comm((0, 1), "0", "default_pg")
F = Comm((0, 1), "1", "activations")  # same members as PAIR and B: told apart by name
B = Comm((0, 1), "2", "gradients")
TRIO = Comm((0, 1, 2), "3", "trio")


def test_crossing_receives_on_one_group_hang():
    """The runtime's old order: each rank posts two receives, then sends; each head waits on a send queued
    behind the other rank's head."""
    rank0 = [Call.recv(PAIR, 1), Call.recv(PAIR, 1), Call.send(PAIR, 1), Call.send(PAIR, 1)]
    rank1 = [Call.recv(PAIR, 0), Call.recv(PAIR, 0), Call.send(PAIR, 0), Call.send(PAIR, 0)]
    with pytest.raises(CommunicationHang) as hang:
        replay([rank0, rank1])
    report = str(hang.value)
    assert "8 calls on ranks [0, 1] never complete" in report
    assert "rank 1's matching send (its call 2) is queued behind its call 0: recv from 0" in report
    assert "rank 0's matching send (its call 2) is queued behind its call 0: recv from 1" in report


def test_one_group_per_direction_completes():
    rank0 = [Call.recv(B, 1), Call.recv(B, 1), Call.send(F, 1), Call.send(F, 1)]
    rank1 = [Call.recv(F, 0), Call.recv(F, 0), Call.send(B, 0), Call.send(B, 0)]
    replay([rank0, rank1])


def test_sends_first_on_both_sides_hang_without_buffering():
    """NCCL may not buffer a send: two ranks that both send before receiving wait on each other."""
    with pytest.raises(CommunicationHang, match="matching receive"):
        replay([[Call.send(PAIR, 1), Call.recv(PAIR, 1)], [Call.send(PAIR, 0), Call.recv(PAIR, 0)]])


def test_a_batch_lets_its_messages_progress_together():
    both = [Message(False, 1), Message(True, 1)], [Message(False, 0), Message(True, 0)]
    replay([[Call.batch(PAIR, *both[0])], [Call.batch(PAIR, *both[1])]])
    with pytest.raises(CommunicationHang):  # the same messages un-batched, receive first on both sides
        replay([[Call.recv(PAIR, 1), Call.send(PAIR, 1)], [Call.recv(PAIR, 0), Call.send(PAIR, 0)]])


def test_a_batch_completes_as_one_before_the_next_call_starts():
    """Rank 1's first receive takes the batch's send, but the batch also waits for rank 1's send, queued
    behind rank 1's second receive, which needs rank 0's send queued behind the batch."""
    rank0 = [Call.batch(PAIR, Message(True, 1), Message(False, 1)), Call.send(PAIR, 1)]
    rank1 = [Call.recv(PAIR, 0), Call.recv(PAIR, 0), Call.send(PAIR, 0)]
    with pytest.raises(CommunicationHang) as hang:
        replay([rank0, rank1])
    assert "call 0: batch[send to 1 [1] float32, recv from 1 [1] float32]" in str(hang.value)
    replay([rank0[:1] + [Wait(0)], rank1[:1] + rank1[2:]])  # without the second message it completes


def test_collectives_complete_when_every_member_reaches_them():
    """Rank 0 joins the all-reduce only after its receive; rank 1 sends first (fine) or only after the
    all-reduce, which cannot complete without rank 0 (a hang)."""
    reduce = Call.collective("all_reduce", TRIO, numel=4, dtype="float32")
    rank0 = [Call.recv(F, 1), Wait(0), reduce]
    replay([rank0, [Call.send(F, 0), reduce], [reduce]])
    with pytest.raises(CommunicationHang) as hang:
        replay([rank0, [reduce, Wait(0), Call.send(F, 0)], [reduce]])
    assert "rank 0 issues its collective (its call 2) after waiting on its call 0" in str(hang.value)


def test_groups_with_the_same_members_are_different_queues():
    """Synchronous collectives on two groups of the same ranks, in opposite orders: a hang, seen only because
    the replay tells the groups apart by name. Issued without waiting, the two queues progress independently."""
    first, second = Call.collective("all_reduce", F, numel=1), Call.collective("all_reduce", B, numel=1)
    replay([[first, Wait(0), second, Wait(2)], [first, Wait(0), second, Wait(2)]])
    with pytest.raises(CommunicationHang):
        replay([[first, Wait(0), second, Wait(2)], [second, Wait(0), first, Wait(2)]])
    replay([[first, second], [second, first]])


def test_a_wait_orders_every_later_call_after_the_waited_call():
    """Each rank waits on its receive before sending on another group: the compute stream waits, and the
    send is queued behind it. Without the waits the same calls complete."""
    rank0 = [Call.recv(B, 1), Wait(0), Call.send(F, 1)]
    rank1 = [Call.recv(F, 0), Wait(0), Call.send(B, 0)]
    with pytest.raises(CommunicationHang) as hang:
        replay([rank0, rank1])
    assert "issued after rank 0 waited on its call 0 (recv from 1" in str(hang.value)
    replay([[rank0[0], rank0[2]], [rank1[0], rank1[2]]])
    replay([[Call.send(F, 1), Wait(0), Call.recv(B, 1)], [Call.recv(F, 0), Wait(0), Call.send(B, 0)]])


def test_a_message_nobody_receives_hangs_and_says_so():
    with pytest.raises(CommunicationHang, match="rank 1 never posts the matching receive"):
        replay([[Call.send(F, 1)], []])
    reduce = Call.collective("all_reduce", PAIR, numel=1)
    with pytest.raises(CommunicationHang, match="rank 1 calls only 1 collectives on default_pg"):
        replay([[reduce, reduce], [reduce]])


def test_mismatches_are_reported():
    with pytest.raises(CommunicationMismatch, match=r"rank 0 sends \[2, 8\] float32 .* receives \[2, 4\] float32"):
        replay([[Call.send(F, 1, (2, 8))], [Call.recv(F, 0, (2, 4))]])
    with pytest.raises(CommunicationMismatch, match="bfloat16"):
        replay([[Call.send(F, 1, dtype="float32")], [Call.recv(F, 0, dtype="bfloat16")]])
    gather = Call.collective("all_gather", PAIR, numel=4)
    with pytest.raises(CommunicationMismatch, match="collective 0 on default_pg"):
        replay([[gather], [Call.collective("all_gather", PAIR, numel=8)]])
    with pytest.raises(CommunicationMismatch, match="broadcast"):
        replay([[gather], [Call.collective("broadcast", PAIR, numel=4)]])


def test_traces_that_cannot_be_real_are_refused():
    with pytest.raises(ValueError, match="does not name an earlier call"):
        replay([[Wait(0), Call.send(F, 1)], [Call.recv(F, 0)]])
    with pytest.raises(ValueError, match="without rank 2"):
        replay([[Call.send(F, 1)], [Call.recv(F, 0)], [Call.collective("barrier", PAIR)]])
    with pytest.raises(ValueError, match="stands for ranks"):
        replay([[Call.collective("barrier", Comm((0, 1), "0"))], [Call.collective("barrier", Comm((1,), "0"))]])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["F", "B"]), max_size=8), st.randoms(use_true_random=False))
def test_per_direction_traffic_completes_in_any_interleaving(directions, random):
    """Activations 0 -> 1 on one group, gradients 1 -> 0 on another: whatever order each rank issues its own
    sends and receives in (each direction in message order), nothing can hang."""
    rank0 = [Call.send(F, 1) if d == "F" else Call.recv(B, 1) for d in directions]
    rank1 = [Call.recv(F, 0) if d == "F" else Call.send(B, 0) for d in directions]
    for trace in (rank0, rank1):
        per_group = {F: [c for c in trace if c.comm == F], B: [c for c in trace if c.comm == B]}
        picks = [F] * len(per_group[F]) + [B] * len(per_group[B])
        random.shuffle(picks)
        trace[:] = [per_group[comm].pop(0) for comm in picks]
    replay([rank0, rank1])
