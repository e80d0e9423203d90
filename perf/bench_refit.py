"""End-to-end refit benchmark (same as ``triton-reshard bench``); see triton_reshard/tools/bench.py.

    python perf/bench_refit.py --cases colocated,disaggregated,fsdp-tp --sizes-gb 0.25,0.5,1.0
"""

import sys

from triton_reshard.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
