"""Compile every Triton-lowered kernel for AMD Instinct targets on this machine (no GPU needed) and print what the
ISA says: registers, LDS, scratch, spills and matrix instructions, as the table of docs/kernels/amd.md.

    python scripts/amd_builds.py                    # gfx942 and gfx950
    python scripts/amd_builds.py --targets gfx950 --json builds.json
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from mxdit.pallas_kernels.amd import AMD_TARGETS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="amd_builds.py", description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=list(AMD_TARGETS), choices=list(AMD_TARGETS))
    parser.add_argument("--json", type=Path, default=None, help="write the rows to this file")
    args = parser.parse_args(argv)
    from mxdit.pallas_kernels.amd import build_table

    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    try:
        rows = build_table(tuple(args.targets))
    except ImportError as e:
        print(f"amd_builds.py: {e}", file=sys.stderr)
        return 2
    print("| kernel | call | target | VGPRs (AGPRs) | SGPRs | LDS bytes | scratch | SGPR spills | MFMA | problems |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r.get('kernel', '')} | {r['call']} | {r['arch']} | | | | | | | {r['error']} |")
            continue
        mfma = ", ".join(m.removeprefix("v_mfma_") for m in r["mfma"]) or "none"
        print(f"| {r['kernel']} | {r['call']} | {r['arch']} | {r['vgprs']} ({r['agprs']}) | {r['sgprs']} | "
              f"{r['lds_bytes']} | {r['scratch_bytes']} | {r['sgpr_spills']} | {mfma} | {'; '.join(r['problems'])} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any("error" in r or r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
