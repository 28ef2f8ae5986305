from lightning_sppo.schedule import format_schedule
from tests.schedule.conftest import parse


def test_grid_has_a_header_and_one_aligned_row_per_rank():
    grid = format_schedule(parse("F0.0 SEND_F0.0@1", "RECV_F0.0@0 F0.0"))
    header, rank0, rank1 = grid.splitlines()
    assert header.split() == ["pos", "|", "0", "1"]
    assert rank0.split() == ["rank", "0", "|", "F0.0", "SEND_F0.0@1"]
    assert rank1.split() == ["rank", "1", "|", "RECV_F0.0@0", "F0.0"]
    assert rank0.index("SEND_F0.0@1") == rank1.rindex("F0.0") == header.index("1")  # columns line up


def test_grid_of_empty_schedule():
    assert format_schedule([]).split() == ["pos", "|"]
    assert format_schedule([[]]).splitlines()[1] == "rank 0 |"
