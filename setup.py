"""Build of the optional native delta codec (``csrc/delta_codec.c`` -> ``triton_reshard._delta_codec``); the
rest of the package's metadata is in pyproject.toml. Without a C compiler (or Python headers) the build warns
and goes on: ``triton_reshard.ops.delta_native`` then runs the numpy reference (the same bytes)."""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: the codec is an accelerator, not a requirement."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 (any compiler or setup failure)
            print(
                f"triton_reshard: native delta codec not built ({exc}); the numpy codec runs", file=sys.stderr
            )

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(
                f"triton_reshard: native delta codec not built ({exc}); the numpy codec runs", file=sys.stderr
            )


CODEC = Extension(
    "triton_reshard._delta_codec",
    sources=[
        "csrc/delta_codec.c",
        "csrc/delta_apply.c",
        "csrc/delta_check.c",  # the check of a message's narrow bodies before the apply's first write
        "csrc/delta_simd.c",  # the block compares and the run-time SIMD choice
        "csrc/delta_stage.c",  # the sparse apply's common blocks on AVX-512
        "csrc/digest.c",  # the integrity digest's one-pass hash
    ],
    # -g0: no debug paths in the binary (the wheel built from the sdist equals the one built from the tree);
    # no -march: the SIMD paths are chosen at run time (csrc/delta_codec.c), so the wheel runs on any x86-64
    extra_compile_args=["-O3", "-g0", "-std=c99", "-fno-strict-aliasing", "-pthread"],
    extra_link_args=["-g0", "-s", "-pthread"],  # -pthread: the apply's second thread (csrc/delta_apply.c)
    optional=True,
)

setup(ext_modules=[CODEC], cmdclass={"build_ext": OptionalBuildExt})
