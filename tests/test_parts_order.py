"""The loop's parts tell each other things only through declared Step fields (training/parts.py: writes / reads):
a reader placed before its writer is refused when the Trainer is built, naming both."""

import pytest

from megalite.training.ft import FaultTolerance
from megalite.training.parts import Losses, Part, check_order


class _Writer(Part):
    writes = ("across",)


class _Reader(Part):
    reads = ("across",)


def test_a_reader_after_its_writer_is_the_order():
    check_order([_Writer(), Part(), _Reader()])
    check_order([_Reader()])  # nobody writes it: the Step's default


def test_a_reader_before_its_writer_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"_Reader reads Step.across, which _Writer writes after it"):
        check_order([_Reader(), _Writer()])


def test_the_losses_read_what_fault_tolerance_writes():
    assert "across" in FaultTolerance.writes and "across" in Losses.reads
