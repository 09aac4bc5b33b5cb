"""engine_common/runtime/big_stack.py: the call runs on its own thread with a 64 MiB stack, its value
or exception comes back, the process-wide default stack size is left as it was; and that stack
holds llguidance compiling a rule chain that overflowed an 8 MiB one (in a child process, so a
crash fails the test instead of killing pytest)."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from engine_common.runtime.big_stack import call_with_big_stack


def test_the_value_comes_back_from_another_thread():
    assert call_with_big_stack(lambda a, b: (a + b, threading.current_thread().name), 2, 3) == \
        (5, "big-stack")


def test_the_exception_comes_back():
    def fail():
        raise KeyError("x")
    with pytest.raises(KeyError):
        call_with_big_stack(fail)


def test_the_default_stack_size_is_restored():
    before = threading.stack_size()
    call_with_big_stack(int)
    assert threading.stack_size() == before


CHILD = """
import llguidance
from engine_common.runtime.big_stack import call_with_big_stack
from tests.support.deep_constraints import lark_chain
grammar = llguidance.grammar_from("grammar", lark_chain(3000))
print(repr(call_with_big_stack(llguidance.LLMatcher.validate_grammar, grammar)))
"""


@pytest.mark.slow
def test_the_big_stack_holds_a_chain_that_overflowed_8_mib():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "''"             # no error: the grammar is valid
