"""The server's one C extension (tokenfeed.server.pack._gather: range copies with the GIL
released). `optional`: without a C compiler the package installs without it and
tokenfeed.server.pack.gather copies with numpy instead (the same bytes, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tokenfeed.server.pack._gather",
            ["server/tokenfeed/server/pack/_gather.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
