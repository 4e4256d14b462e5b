"""``Launcher.prepare`` (kernels/triton_launch.py) on CPU, with a stand-in for Triton's compiled
kernel: a prepared launch hands the compiled launch function exactly the arguments the
launcher's own fast path hands it for the same values (the lean path's casts rely on it), and
goes through Triton's wrapper when a launch hook is registered."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402

from megatron_fp8.kernels import triton_launch  # noqa: E402


class _Run:
    """The compiled kernel's ``run``: records what its C launch function receives."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.wrapped: list[tuple[Any, ...]] = []
        self.global_scratch_size = 0
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = True
        self.launch_pdl = False

    def launch(self, *args: Any) -> None:
        self.calls.append(args)

    def __call__(self, *args: Any) -> None:  # Triton's Python wrapper (used with hooks)
        self.wrapped.append(args)


class _Fn:
    """A JIT function's stand-in: ``fn[grid](...)`` compiles (once) and launches through Triton."""

    def __init__(self, names: list[str], constexpr: list[bool]) -> None:
        self.params = [SimpleNamespace(name=n, is_constexpr=c) for n, c in zip(names, constexpr)]
        self.run = _Run()
        self.kernel = SimpleNamespace(run=self.run, function="fn", packed_metadata="meta",
                                      launch_metadata=lambda grid, stream, *v: ("md", grid))
        self.plain_launches = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.plain_launches += 1
            return self.kernel
        return launch


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # the whole driver module: its ``active`` is a lazy proxy that needs a GPU to resolve
    monkeypatch.setattr(triton.runtime, "driver", SimpleNamespace(active=SimpleNamespace(
        get_current_stream=lambda device: 77)))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _launcher() -> tuple[triton_launch.Launcher, _Fn]:
    fn = _Fn(["x", "y", "m", "k", "BLOCK", "MODE"], [False, False, False, False, True, True])
    return triton_launch.Launcher(fn), fn


def test_prepared_launch_passes_what_the_launcher_passes(fake_cuda: None) -> None:
    launcher, fn = _launcher()
    x, y, x2, y2 = (torch.empty(64) for _ in range(4))
    prepared = launcher.prepare((4,), 2, x, y, 64, 128, BLOCK=128, MODE=1)  # compiles and launches once
    assert fn.plain_launches == 1 and prepared is not None
    launcher((4,), x2, y2, 64, 128, BLOCK=128, MODE=1)  # the launcher's own fast path
    prepared(x2, y2)
    assert fn.plain_launches == 1 and len(fn.run.calls) == 2
    assert fn.run.calls[0] == fn.run.calls[1]
    head = (4, 1, 1, 77, "fn", True, False, None, None, "meta", None, None, None)
    assert fn.run.calls[1] == (*head, x2, y2, 64, 128, 128, 1)


def test_prepared_launch_goes_through_triton_with_a_hook(fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher, fn = _launcher()
    x, y = torch.empty(64), torch.empty(64)
    prepared = launcher.prepare((2, 3), 2, x, y, 64, 128, BLOCK=128, MODE=1)
    assert prepared is not None
    hooks = SimpleNamespace(launch_enter_hook=lambda *a: None, launch_exit_hook=None)
    monkeypatch.setattr(triton.knobs, "runtime", hooks)
    prepared(x, y)
    assert not fn.run.calls and len(fn.run.wrapped) == 1
    assert fn.run.wrapped[0][:6] == (2, 3, 1, 77, "fn", "meta")
    assert fn.run.wrapped[0][-6:] == (x, y, 64, 128, 128, 1)


def test_no_prepared_launch_under_the_interpreter(fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launcher, fn = _launcher()
    assert launcher.prepare((1,), 2, torch.empty(4), torch.empty(4), 4, 4, BLOCK=128, MODE=1) is None
    assert fn.plain_launches == 1  # it still launched


def test_a_hook_launches_through_triton_once(fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a launch hook registered, a kept kernel launches through Triton's own path, once: a
    hook raising TypeError after the launch propagates instead of being taken for an API mismatch
    and launching again (an accumulating kernel would add twice)."""
    launcher, fn = _launcher()
    x, y = torch.empty(64), torch.empty(64)
    launcher((2,), x, y, 64, 128, BLOCK=128, MODE=1)  # compiles and keeps
    monkeypatch.setattr(triton.knobs, "runtime", SimpleNamespace(launch_enter_hook=lambda *a: None,
                                                                 launch_exit_hook=None))
    launcher((2,), x, y, 64, 128, BLOCK=128, MODE=1)
    assert fn.plain_launches == 2 and not fn.run.calls and not fn.run.wrapped and launcher.fast

    def hook_fails(*args: Any, **kwargs: Any) -> Any:
        fn.plain_launches += 1  # the launch happened; the hook after it fails
        raise TypeError("a profiler hook's own error")
    monkeypatch.setattr(_Fn, "__getitem__", lambda self, grid: hook_fails)
    with pytest.raises(TypeError, match="profiler hook"):
        launcher((2,), x, y, 64, 128, BLOCK=128, MODE=1)
    assert fn.plain_launches == 3 and launcher.fast


def test_an_api_mismatch_falls_back_before_anything_ran(fake_cuda: None) -> None:
    """A compiled launch function that rejects its arguments (another Triton's API) ran nothing:
    the launcher launches plainly once, and from then on always plainly."""
    launcher, fn = _launcher()
    x, y = torch.empty(64), torch.empty(64)
    launcher((2,), x, y, 64, 128, BLOCK=128, MODE=1)

    def rejects(*args: Any) -> None:
        raise TypeError("function takes exactly 20 arguments")
    launcher.kernels = {k: v._replace(direct=rejects) for k, v in launcher.kernels.items()}
    launcher((2,), x, y, 64, 128, BLOCK=128, MODE=1)
    assert fn.plain_launches == 2 and not launcher.fast
    launcher((2,), x, y, 64, 128, BLOCK=128, MODE=1)
    assert fn.plain_launches == 3 and not fn.run.calls


def test_no_hook_api_falls_back_to_plain_launches(fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton without the launch-hook settings this launcher reads: one plain launch, and plain
    launches from then on."""
    launcher, fn = _launcher()
    x, y = torch.empty(64), torch.empty(64)
    launcher((2,), x, y, 64, 128, BLOCK=128, MODE=1)
    monkeypatch.setattr(triton, "knobs", SimpleNamespace())
    launcher((2,), x, y, 64, 128, BLOCK=128, MODE=1)
    assert fn.plain_launches == 2 and not launcher.fast and not fn.run.calls
