"""The pinning rule (seed 002), without torch: Recommend plans with it on a machine that has no torch yet."""
from __future__ import annotations

import os
import platform

GIB = 1024 ** 3

# Windows (WDDM) refuses page-locked memory beyond about half of RAM; ComfyUI budgets 45%.
WINDOWS_PIN_FRACTION = 0.45
# WSL2 page-locks far less (about 1 GiB in reports); beyond it pins fail and can poison later ones.
WSL_PIN_CAP_BYTES = 1 * GIB
# Seed 002: pinned pages cannot be swapped, so pin only when available RAM covers the set twice.
RAM_COVER_FACTOR = 2.0


def os_kind() -> str:
    """'linux', 'wsl', 'windows' or 'darwin': pinning limits differ between them."""
    system = platform.system().lower()
    if system == "linux":
        release = platform.release().lower()
        if "microsoft" in release or "wsl" in release or os.environ.get("WSL_DISTRO_NAME"):
            return "wsl"
        return "linux"
    if system.startswith("win"):
        return "windows"
    return system or "unknown"


def host_memory() -> tuple[int | None, int | None]:
    """(available, total) host RAM in bytes; None where it cannot be read."""
    try:
        import psutil
    except ImportError:
        return None, None
    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def pin_decision(pinned_set_bytes: int, available_ram_bytes: int | None, os_name: str, has_cuda: bool,
                 total_ram_bytes: int | None = None, budget_bytes: int | None = None) -> tuple[bool, str]:
    """Should a pinned set of ``pinned_set_bytes`` be page-locked here? Returns (pin, reason).

    Seed 002's rule: no CUDA -> no (nothing DMAs from it); RAM unknown -> yes (pinning fails soft
    per component anyway); otherwise pin only when available RAM >= 2x the pinned set. An explicit
    ``budget_bytes`` replaces the RAM rule. OS caps (Windows ~45% of RAM, WSL ~1 GiB) apply on top.
    """
    gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    os_name = (os_name or "").lower()
    if not has_cuda:
        return False, "no CUDA device: nothing DMAs from pinned memory (CPU tier)"
    if pinned_set_bytes <= 0:
        return False, "nothing to pin"
    if os_name == "wsl" and pinned_set_bytes > WSL_PIN_CAP_BYTES:
        return False, (f"WSL2 page-locks only about {gib(WSL_PIN_CAP_BYTES)}; pinning {gib(pinned_set_bytes)} "
                       f"would fail and can poison later pins")
    if os_name == "windows" and total_ram_bytes and pinned_set_bytes > WINDOWS_PIN_FRACTION * total_ram_bytes:
        return False, (f"Windows caps page-locked memory near half of RAM: {gib(pinned_set_bytes)} > "
                       f"{WINDOWS_PIN_FRACTION:.0%} of {gib(total_ram_bytes)}")
    if budget_bytes is not None:
        if pinned_set_bytes > budget_bytes:
            return False, f"pinned set {gib(pinned_set_bytes)} exceeds the pin budget {gib(budget_bytes)}"
        return True, f"pinned set {gib(pinned_set_bytes)} fits the pin budget {gib(budget_bytes)}"
    if available_ram_bytes is None:
        return True, "host RAM unknown; pinning fails soft per component"
    if available_ram_bytes < RAM_COVER_FACTOR * pinned_set_bytes:
        return False, (f"available RAM {gib(available_ram_bytes)} < {RAM_COVER_FACTOR:g}x the pinned set "
                       f"{gib(pinned_set_bytes)}: pinned pages cannot be swapped out")
    return True, (f"available RAM {gib(available_ram_bytes)} >= {RAM_COVER_FACTOR:g}x the pinned set "
                  f"{gib(pinned_set_bytes)}")
