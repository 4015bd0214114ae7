"""Each reversion the explorer is tried against still applies to the code it takes back out."""

from __future__ import annotations

import pytest

from tests.explorer.reverted import REVERSIONS, ROOT


@pytest.mark.parametrize("name", sorted(REVERSIONS))
def test_the_fixed_code_is_there_exactly_once(name: str) -> None:
    reversion = REVERSIONS[name]
    text = (ROOT / reversion.path).read_text()

    assert text.count(reversion.fixed) == 1, f"{name} no longer applies to {reversion.path}"
