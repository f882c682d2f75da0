"""A directory of this user's own, reached from / without following a link: where gpusnap (as root)
keeps logs and records under paths a setting names (CRIU's logs, the CRIU hook's log and state), so
that no other user can point a write of ours elsewhere by a link or a directory they can write in.
Standard library only: the CRIU hook imports it."""
from __future__ import annotations

import os


def own_dir(path: str) -> int:
    """PATH (absolute) opened as a directory one component at a time from /, no link followed anywhere
    (O_NOFOLLOW on each); each existing component this user's or root's and writable by no one else
    (a sticky one like /tmp is fine: others cannot move what is in it); the missing ones created 0700;
    the last one this user's own and writable by no one else. OSError otherwise (not a link-free
    path of this user's)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    me = os.geteuid()
    fd = os.open("/", flags)
    try:
        parts = [p for p in os.path.normpath(path).split("/") if p]
        for i, part in enumerate(parts):
            if part == "..":
                raise OSError(0, "the path goes up ('..')")
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:  # made meanwhile (another run): checked like any other below
                    pass
                nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
            st = os.fstat(fd)
            last = i == len(parts) - 1
            if st.st_uid not in ((me,) if last else (0, me)) or (
                    st.st_mode & 0o022 and (last or not st.st_mode & 0o1000)):
                raise OSError(0, f"{'the directory' if last else '/' + '/'.join(parts[:i + 1])} is not this "
                                 "user's own, or others may write in it")
        if not parts:
            raise OSError(0, "not a directory of its own")
        return fd
    except BaseException:
        os.close(fd)
        raise
