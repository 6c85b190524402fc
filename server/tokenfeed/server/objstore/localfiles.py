"""The local backend of object storage: files and globs (`file://` URIs and bare paths), the
embedded default with nothing to start. An object's version is its modification time."""

from __future__ import annotations

import glob
import os
import stat
from pathlib import Path
from typing import BinaryIO

from tokenfeed.server.errors import SourceChangedError, SourceError
from tokenfeed.server.objstore.objects import ObjectInfo


def _local_path(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


class LocalBackend:
    """Local files and globs (`**` recurses); a directory is every file under it."""

    parallel_reads = 1

    def list(self, pattern: str) -> list[ObjectInfo]:
        path = _local_path(pattern)
        if not glob.has_magic(path) and os.path.isdir(path):
            # A layout (an MDS or save_to_disk directory, a Hub repository) is named by its
            # directory: everything under it, as on object storage.
            path = os.path.join(glob.escape(path), "**")
        matches = glob.glob(path, recursive=True) if glob.has_magic(path) else [path]
        infos: list[ObjectInfo] = []
        dirs: dict[str, str] = {}
        for match in matches:
            try:
                st = os.stat(match)
            except OSError as e:
                raise SourceError(f"cannot stat source {match}: {e.strerror}") from e
            if stat.S_ISDIR(st.st_mode):
                continue
            infos.append(ObjectInfo(_resolved(match, dirs), st.st_size, str(st.st_mtime_ns)))
        return sorted(infos)

    def _check(self, obj: ObjectInfo, fd: int) -> None:
        st = os.fstat(fd)
        if st.st_size != obj.size or str(st.st_mtime_ns) != obj.version:
            raise SourceChangedError(
                f"source {obj.uri} changed after it was pinned: size {obj.size} -> {st.st_size}, "
                f"mtime_ns {obj.version} -> {st.st_mtime_ns}; restart the job on a stable corpus"
            )

    def read_range(self, obj: ObjectInfo, start: int, end: int) -> bytes:
        with self.open(obj) as f:
            f.seek(start)
            return f.read(max(0, min(end, obj.size) - start))

    def open(self, obj: ObjectInfo) -> BinaryIO:
        try:
            f = open(_local_path(obj.uri), "rb")  # noqa: SIM115 - returned to the caller
        except OSError as e:
            raise SourceError(f"cannot open source {obj.uri}: {e.strerror}") from e
        try:
            self._check(obj, f.fileno())
        except BaseException:
            f.close()
            raise
        return f


def _resolved(path: str, dirs: dict[str, str]) -> str:
    """`Path(path).resolve()` with each directory resolved once per listing: resolving walks
    every component of a path (an lstat each), which made up most of listing 10,000 small
    files (bench/smallobjects.py). Only a symlink's own target needs the whole walk."""
    if os.path.islink(path):
        return str(Path(path).resolve())
    head, name = os.path.split(path)
    if head not in dirs:
        dirs[head] = str(Path(head).resolve())
    return os.path.join(dirs[head], name)
