"""The server's C extensions: tokenfeed.server.pack._gather (range copies with the GIL released,
the starts inside rows) and tokenfeed.server.sampling._feistel (the sample order's Feistel
network). `optional`: without a C compiler the package installs without them and
tokenfeed.server.pack.gather and sampling.order run their numpy twins instead (the same bytes,
slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tokenfeed.server.pack._gather",
            ["server/tokenfeed/server/pack/_gather.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "tokenfeed.server.sampling._feistel",
            ["server/tokenfeed/server/sampling/_feistel.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
