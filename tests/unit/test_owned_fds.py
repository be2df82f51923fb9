"""FDs owned during set-up: ``OwnedFd`` itself, and the VMM chunks' set-up rolled back on a
failure part way (driver calls faked, FDs real; the GPU suite makes real chunks)."""

import os

import pytest

from ipcpool.fds import OwnedFd
from ipcpool.errors import InvalidRequest, IpcPoolError


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def new_fd() -> int:
    return os.memfd_create("owned-test", os.MFD_CLOEXEC)


def test_an_owned_fd_is_closed_once_unless_taken():
    fd = new_fd()
    with OwnedFd(fd) as owned:
        assert owned.fd == fd
    assert not is_open(fd) and owned.fd == -1
    owned.close()                                # again: nothing
    with pytest.raises(ValueError, match="already taken or closed"):
        owned.take()
    fd = new_fd()
    with pytest.raises(RuntimeError):
        with OwnedFd(fd):
            raise RuntimeError("set-up failed")
    assert not is_open(fd)
    fd = new_fd()
    with OwnedFd(fd) as owned:
        assert owned.take() == fd and owned.fd == -1
    assert is_open(fd)
    os.close(fd)


vmm = pytest.importorskip("ipcpool.backend.cuda.vmm", exc_type=ImportError)
OK = vmm.cu.CUresult.CUDA_SUCCESS
BAD = vmm.cu.CUresult.CUDA_ERROR_INVALID_VALUE


class Props:
    class allocFlags:   # noqa: N801 (the driver's struct field)
        compressionType = 0


@pytest.fixture
def driver(monkeypatch):
    """cuMem* calls faked: ``fail`` names the one that fails, once ``after`` more calls of it have
    succeeded; ``released`` lists the handles released."""
    state = {"fail": None, "after": 0, "released": [], "next": 100}

    def call(name, value):
        def fake(*args):
            if state["fail"] == name:
                if state["after"]:
                    state["after"] -= 1
                else:
                    state["fail"] = None
                    return (BAD,)
            return (OK, value(*args)) if value else (OK,)
        monkeypatch.setattr(vmm.cu, name, fake)

    def handle(*args):
        state["next"] += 1
        return state["next"]

    call("cuMemCreate", handle)
    call("cuMemImportFromShareableHandle", handle)
    call("cuMemExportToShareableHandle", lambda *a: new_fd())
    call("cuMemGetAllocationPropertiesFromHandle", lambda *a: Props())
    monkeypatch.setattr(vmm.cu, "cuMemRelease", lambda h: state["released"].append(h) or (OK,))
    return state


def test_a_chunk_whose_set_up_fails_releases_its_allocation_and_closes_its_fd(driver, monkeypatch):
    fds = []
    export = vmm.cu.cuMemExportToShareableHandle
    monkeypatch.setattr(vmm.cu, "cuMemExportToShareableHandle", lambda *a: fds.append(export(*a)[1]) or (OK, fds[-1]))
    driver["fail"] = "cuMemGetAllocationPropertiesFromHandle"
    with pytest.raises(IpcPoolError, match="cuMemGetAllocationPropertiesFromHandle failed"):
        vmm.Chunk(0, 2 << 20, False)
    assert driver["released"] == [101] and not is_open(fds[0])
    fd = new_fd()
    driver["fail"] = "cuMemGetAllocationPropertiesFromHandle"
    with pytest.raises(IpcPoolError):
        vmm.Chunk.restore(fd, 2 << 20)
    assert driver["released"] == [101, 102] and not is_open(fd)
    fd = new_fd()
    driver["fail"] = "cuMemImportFromShareableHandle"
    with pytest.raises(IpcPoolError):
        vmm.Chunk.restore(fd, 2 << 20)
    assert driver["released"] == [101, 102] and not is_open(fd)   # nothing imported to release


def test_chunks_are_made_or_restored_all_or_none(driver):
    made = vmm.create_chunks(0, [2 << 20] * 2, False)
    assert [c.handle for c in made] == [101, 102] and all(is_open(c.fd) for c in made)
    for c in made:
        c.close()
    released = len(driver["released"])
    driver["fail"], driver["after"] = "cuMemCreate", 1   # the second of a batch fails
    with pytest.raises(IpcPoolError, match="cuMemCreate"):
        vmm.create_chunks(0, [2 << 20] * 3, False)
    assert driver["released"][released:] == [103]        # the first, made, released again

    fds = [new_fd() for _ in range(3)]
    with pytest.raises(InvalidRequest, match="2 stored chunks but 3 FDs"):
        vmm.restore_chunks(fds, [2 << 20] * 2)
    assert not any(map(is_open, fds))

    fds = [new_fd() for _ in range(3)]
    released = len(driver["released"])
    driver["fail"], driver["after"] = "cuMemImportFromShareableHandle", 1   # the second import fails
    with pytest.raises(IpcPoolError):
        vmm.restore_chunks(fds, [2 << 20] * 3)
    assert not any(map(is_open, fds))                         # the first chunk's, the failed, the rest
    assert len(driver["released"]) == released + 1            # the first chunk, restored, released again
