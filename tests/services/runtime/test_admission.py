"""A role's bounded queue refuses at once past its limit, and counts what is inside."""

from __future__ import annotations

import pytest

from services.protocol.errors import Overloaded
from services.runtime.admission import QUEUE_DEPTH, Admission


def test_admits_up_to_the_limit_then_refuses_with_retry_after():
    admission = Admission("testrole", 2)
    with admission.admit(), admission.admit():
        assert QUEUE_DEPTH.labels("testrole")._value.get() == 2
        with pytest.raises(Overloaded) as err:
            with admission.admit():
                pass
        assert err.value.code == "testrole_queue_full" and err.value.retry_after_s == 1.0
    assert admission.inside == 0
    with admission.admit():  # room again
        assert admission.inside == 1
