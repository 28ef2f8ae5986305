import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_sppo.schedule import Action, Op


def test_ops_compare_equal_to_their_strings():
    assert Op.F == "F" and Op.B == "B" and Op.SEND_F == "SEND_F" and Op.RECV_B == "RECV_B"
    assert isinstance(Op.F, str) and Op("B") is Op.B
    assert {Op.F: 1}["F"] == 1  # usable as dict keys interchangeably with the strings


def test_ops_classify():
    assert [op for op in Op if op.is_compute] == [Op.F, Op.B]
    assert [op for op in Op if op.is_send] == [Op.SEND_F, Op.SEND_B]
    assert [op for op in Op if op.is_recv] == [Op.RECV_F, Op.RECV_B]
    assert Op.RECV_F.payload is Op.F and Op.SEND_B.payload is Op.B and Op.B.payload is Op.B


@pytest.mark.parametrize(
    ("action", "text"),
    [
        (Action(Op.F, 0, 3), "F0.3"),
        (Action(Op.B, 12, 0), "B12.0"),
        (Action(Op.SEND_F, 1, 2, peer=3), "SEND_F1.2@3"),
        (Action(Op.RECV_B, 0, 0), "RECV_B0.0"),
    ],
)
def test_action_string_form(action, text):
    assert str(action) == text == repr(action)
    assert Action.from_str(text) == action


def test_action_fields_and_immutability():
    action = Action.from_str("RECV_F2.5@1")
    assert (action.op, action.microbatch, action.subsequence, action.peer, action.unit) == (Op.RECV_F, 2, 5, 1, (2, 5))
    with pytest.raises(AttributeError):
        action.microbatch = 3
    assert str([Action(Op.F, 0, 0), Action(Op.B, 0, 0)]) == "[F0.0, B0.0]"


@given(
    op=st.sampled_from(list(Op)),
    microbatch=st.integers(0, 10_000),
    subsequence=st.integers(0, 10_000),
    peer=st.none() | st.integers(0, 64),
)
def test_action_string_round_trip(op, microbatch, subsequence, peer):
    action = Action(op, microbatch, subsequence, peer)
    assert Action.from_str(str(action)) == action
    assert str(Action.from_str(str(action))) == str(action)


@pytest.mark.parametrize("text", ["", "X0.1", "F0", "F-1.2", "F0.1@", "SEND0.1", "f0.1", "F0.1.2"])
def test_action_from_str_rejects_malformed(text):
    with pytest.raises(ValueError, match=r"is not of the form <op><microbatch>\.<subsequence>"):
        Action.from_str(text)
