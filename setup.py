"""The server's C extensions: tokenfeed.server.pack._gather (range copies with the GIL released,
the starts inside rows), tokenfeed.server.pack._rowmessages (a group's messages made with its
rows copied into them) and tokenfeed.server.sampling._feistel (the sample order's Feistel
network). `optional`: without a C compiler the package installs without them and
tokenfeed.server.pack.gather, pack.rowmessages and sampling.order run their twins instead (the
same bytes, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tokenfeed.server.pack._gather",
            ["server/tokenfeed/server/pack/_gather.c"],
            depends=["server/tokenfeed/server/pack/_buffers.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "tokenfeed.server.pack._rowmessages",
            ["server/tokenfeed/server/pack/_rowmessages.c"],
            depends=["server/tokenfeed/server/pack/_buffers.h"],
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
