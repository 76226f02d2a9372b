"""Support modules: progress a UI can observe, files written new and whole."""
import pytest

from localllm import atomic
from localllm.progress import observe, progress


@pytest.mark.parametrize("hard_links", [True, False])
def test_write_new_refuses_an_existing_file(tmp_path, monkeypatch, hard_links):
    if not hard_links:  # as on FAT or some network shares
        def no_link(*a):
            raise PermissionError("hard links are not supported here")
        monkeypatch.setattr(atomic.os, "link", no_link)
    p = tmp_path / "a.json"
    atomic.write_new(p, b"one")
    with pytest.raises(FileExistsError):
        atomic.write_new(p, b"two")
    assert p.read_bytes() == b"one" and [f.name for f in tmp_path.iterdir()] == ["a.json"]


def test_progress_can_be_observed_instead_of_printed(capsys):
    seen = []
    with observe(lambda *a: seen.append(a)):
        for _ in progress(range(3), "pinning residuals", unit="layer"):
            pass
    assert seen[-1] == ("pinning residuals", 3, 3, "layer")
    assert capsys.readouterr().err == ""
    seen.clear()
    for _ in progress(range(3), "plain"):  # outside observe(): a terminal bar again, the observer sees nothing
        pass
    assert seen == []
