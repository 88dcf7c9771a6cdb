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


def _step():
    from megalite.training.trainer import Step
    return Step(consumed=0, batch=8, num_micro=2, total=None, idle=False, timed=False, times={})


class _Teller(Part):
    writes = ("across",)

    def tell(self, it, step):
        return {"across": sum}


class _Seer(Part):
    reads = ("across",)

    def after(self, it, step):
        self.seen = step


def test_the_step_record_is_immutable():
    import dataclasses
    with pytest.raises(dataclasses.FrozenInstanceError):
        _step().across = sum


def test_a_part_tells_the_parts_after_it_through_a_new_record():
    import types
    from megalite.training.trainer import Trainer
    seer_before, seer_after, first = _Seer(), _Seer(), _step()
    loop = types.SimpleNamespace(parts=[seer_before, _Teller(), seer_after])
    assert Trainer.after(loop, 1, first) is None
    assert seer_before.seen.across is None and seer_after.seen.across is sum and first.across is None


def test_a_part_telling_a_field_it_does_not_declare_is_refused():
    import types
    from megalite.training.trainer import Trainer

    class Sly(_Teller):
        writes = ()
    with pytest.raises(ValueError, match=r"Sly tells Step.across, which it does not declare"):
        Trainer.after(types.SimpleNamespace(parts=[Sly()]), 1, _step())
