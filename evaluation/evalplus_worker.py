"""Child-process entry that runs EvalPlus on one samples file (used by evalplus_score).

    python -m evaluation.evalplus_worker SAMPLES_JSONL

The parent sets MBPP_OVERRIDE_PATH (the subset's problems), XDG_CACHE_HOME (where the
ground-truth cache lives) and EVALPLUS_MAX_MEMORY_BYTES in this process's environment;
evalplus reads them at import, which is why scoring happens in a fresh process. Generated
code only ever runs inside evalplus's own sandboxed checker (a further child per problem,
with its time limits, memory limit and disabled destructive calls).
"""

from __future__ import annotations

import os
import sys
import traceback


def main() -> None:
    samples = sys.argv[1]
    from evalplus.evaluate import evaluate  # imported here: after the environment is final

    code = 0
    try:
        evaluate("mbpp", samples=samples, parallel=1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # evaluate() leaves a non-daemon "stuck checker" thread that sleeps 20 s before it
    # notices the run is over (and never ends if the run failed half-way); the results
    # file is already written, so leave without waiting for it.
    os._exit(code)


if __name__ == "__main__":
    main()
