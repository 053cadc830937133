"""Request.tokens reads prompt and output in place and behaves like the concatenated list."""

from __future__ import annotations

import pytest

from loraplex.engine.request import Tokens


@pytest.mark.parametrize("n_prompt", [0, 1, 5])
@pytest.mark.parametrize("n_output", [0, 1, 4, 9])
def test_tokens_view_matches_the_list(n_prompt: int, n_output: int) -> None:
    prompt, output = list(range(10, 10 + n_prompt)), list(range(50, 50 + n_output))
    full = prompt + output
    t = Tokens(prompt, output)
    assert len(t) == len(full) and list(t) == full and t == full and t == tuple(full)
    n = len(full)
    for lo in range(-n - 1, n + 2):
        for hi in range(-n - 1, n + 2):
            assert t[lo:hi] == full[lo:hi], (lo, hi)
    assert t[::2] == full[::2] and t[::-1] == full[::-1]
    for i in range(-n, n):
        assert t[i] == full[i]
    for bad in (n, -n - 1):
        with pytest.raises(IndexError):
            t[bad]
    output.append(99)  # a view: later tokens show
    assert t[-1] == 99 and len(t) == n + 1
    assert t != full and t == [*full, 99]
