"""`python -m jaxsys.train` whose save of one step stalls just before Orbax commits it.

Used by tests/test_checkpoint_crash.py: with JAXSYS_TEST_STALL_STEP=s, the asynchronous save of step s
writes all its files into Orbax's temporary directory, then touches JAXSYS_TEST_STALL_MARKER and
sleeps instead of renaming the directory to its final name. The test SIGKILLs the process then, so
the kill lands inside a real asynchronous save at a known point.
"""

import os
import sys
import time

from orbax.checkpoint._src.path import atomicity

STALL_STEP = os.environ["JAXSYS_TEST_STALL_STEP"]
MARKER = os.environ["JAXSYS_TEST_STALL_MARKER"]
_finalize = atomicity.AtomicRenameTemporaryPath.finalize


async def _stalling_finalize(self):
    if self._final_path.name == STALL_STEP:
        with open(MARKER, "w") as f:
            f.write(str(self.get()))
        time.sleep(600)  # the test kills the process here
    return await _finalize(self)


atomicity.AtomicRenameTemporaryPath.finalize = _stalling_finalize

if __name__ == "__main__":
    from jaxsys import train

    sys.exit(train.cli())
