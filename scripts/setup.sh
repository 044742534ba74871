#!/usr/bin/env bash
# Installs everything gpucleanup needs on a fresh Debian/Ubuntu machine:
#   Debian packages (as root, or through sudo), a virtual environment in .venv,
#   and gpucleanup itself with its test extra.
# Safe to run again: it installs only what is missing, and rebuilds gpucleanup only when its sources
# changed since the last build (a SHA-256 of native/, ipython_ext/, share/, CMakeLists.txt, pyproject.toml
# and LICENSE, kept in .venv/gpucleanup-build/sources.sha256 next to the wheel it was built into; that
# wheel is also what scripts/test.sh installs into its lowest-IPython venv).
# Usage: scripts/setup.sh [--system-only]   (--system-only: the Debian packages and the CUDA headers check,
#   nothing else; scripts/build_wheels.sh uses it)
# Environment: GPUCLEANUP_REBUILD=1 rebuilds even when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

system_only=0
case "${1:-}" in
  "") ;;
  --system-only) system_only=1 ;;
  *) echo "setup: unknown argument '$1' (usage: scripts/setup.sh [--system-only])" >&2; exit 2 ;;
esac

started=$SECONDS
say() { echo "setup: $*"; }

deb_packages=(g++ pkg-config nlohmann-json3-dev libgtest-dev libgmock-dev libzmq3-dev cppzmq-dev libssl-dev patchelf
  libasan8 libubsan1 libtsan2)
# The Jupyter Server page's tests drive Debian's headless Chromium through its chromedriver (Selenium).
deb_packages+=(chromium chromium-driver)
deb_packages+=(clang-14 libclang-rt-14-dev)  # scripts/fuzz.sh: clang and its libFuzzer runtime (libclang_rt.fuzzer)
command -v cmake >/dev/null || deb_packages+=(cmake)
command -v ninja >/dev/null || deb_packages+=(ninja-build)
command -v python3 >/dev/null || deb_packages+=(python3 python3-venv)

say "checking the Debian packages (${#deb_packages[@]})"
missing=()
for p in "${deb_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then sudo=(); elif command -v sudo >/dev/null; then sudo=(sudo); else
    echo "setup: need root to install Debian packages: ${missing[*]}" >&2; exit 1; fi
  say "installing ${missing[*]} with apt-get"
  step=$SECONDS
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  say "Debian packages installed in $((SECONDS - step)) s"
fi

# The JupyterLab extension's stale-build test rebuilds it with Debian's webpack (scripts/build_labextension.sh)
if ! command -v webpack >/dev/null || ! node -e 'require("webpack")' 2>/dev/null; then
  if [ "$(id -u)" = 0 ]; then bash scripts/build_labextension.sh --install-only; else
    say "webpack is missing: the JupyterLab extension's stale-build test will be skipped (run scripts/build_labextension.sh as root)"; fi
fi

cuda_home=${CUDA_HOME:-/usr/local/cuda}
if [ ! -f "$cuda_home/include/cudaTypedefs.h" ]; then
  echo "setup: the CUDA Toolkit headers (cuda.h, cudaTypedefs.h) were not found under $cuda_home:" >&2
  echo "       install the CUDA Toolkit or set CUDA_HOME to its root" >&2
  exit 1
fi
say "CUDA Toolkit headers: $cuda_home/include"
[ "$system_only" = 0 ] || exit 0

if [ -x .venv/bin/python ]; then
  say "using the virtual environment .venv ($(.venv/bin/python --version))"
else
  say "creating the virtual environment .venv ($(python3 --version))"
  python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import sys, pip; sys.exit(int(pip.__version__.split(".")[0]) < 23)' 2>/dev/null; then
  say "upgrading pip in .venv"
  .venv/bin/python -m pip install -q --upgrade "pip>=23" >/dev/null
fi

# What the installed gpucleanup is built from: every file (tracked, or new and not ignored) under the
# package's sources, by name and content, and the CUDA headers' location.
sources_hash() {
  CUDA_HOME_USED="$cuda_home" python3 - <<'EOF'
import hashlib, os, subprocess
paths = ["native", "ipython_ext", "share", "CMakeLists.txt", "pyproject.toml", "LICENSE"]
try:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *paths],
                         check=True, capture_output=True).stdout
    files = sorted({f for f in out.decode().split("\0") if f and os.path.isfile(f)})
except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist)
    files = sorted(os.path.join(d, f) for p in paths for d, _, fs in os.walk(p) for f in fs
                   if "__pycache__" not in d) + [p for p in paths if os.path.isfile(p)]
h = hashlib.sha256(("cuda=" + os.environ["CUDA_HOME_USED"] + "\n").encode())
for f in files:
    with open(f, "rb") as fh:
        h.update(f"{f}\0{hashlib.sha256(fh.read()).hexdigest()}\n".encode())
print(h.hexdigest())
EOF
}

built_dir=.venv/gpucleanup-build
stamp=$built_dir/sources.sha256
hash=$(sources_hash)
wheel=$(ls "$built_dir"/gpucleanup-*.whl 2>/dev/null | head -1 || true)
if [ "${GPUCLEANUP_REBUILD:-0}" != 1 ] && [ -n "$wheel" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$hash" ] \
  && .venv/bin/python -c 'import importlib.metadata as m; m.distribution("gpucleanup")' 2>/dev/null; then
  say "gpucleanup in .venv is built from the current sources (${hash:0:12}): not rebuilding"
else
  say "building gpucleanup's wheel: the C++ library with CMake through scikit-build-core"
  step=$SECONDS
  rm -f "$stamp"
  rm -rf "$built_dir.new"
  mkdir -p "$built_dir.new"
  .venv/bin/python -m pip wheel -q --no-deps -w "$built_dir.new" .
  wheel_new=$(ls "$built_dir.new"/gpucleanup-*.whl)
  say "built $(basename "$wheel_new") in $((SECONDS - step)) s"
  rm -rf "$built_dir"
  mv "$built_dir.new" "$built_dir"
  wheel=$built_dir/$(basename "$wheel_new")

  say "installing gpucleanup and its test extra (pytest, ipykernel, jupyter_client, nbclient, ...) into .venv"
  step=$SECONDS
  # Same version number, new build: replace the installed package, then add what the extra needs.
  .venv/bin/python -m pip install -q --force-reinstall --no-deps "$wheel"
  .venv/bin/python -m pip install -q "$wheel[test]"
  echo "$hash" >"$stamp"
  say "installed in $((SECONDS - step)) s"
fi

# PyTorch's CPU build proves the torch adapter never initialises CUDA. It is
# large; take it only where a local wheel makes it cheap (this is what CI has).
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if compgen -G "/opt/wheels/torch-2.13.0+cpu-*.whl" >/dev/null; then
    say "installing the PyTorch CPU build from /opt/wheels"
    step=$SECONDS
    if .venv/bin/python -m pip install -q "torch==2.13.0"; then
      say "PyTorch installed in $((SECONDS - step)) s"
    else
      say "torch CPU build not installed; its tests will be skipped"
    fi
  else
    say "no local PyTorch CPU wheel; the PyTorch tests will be skipped"
  fi
fi
say "done in $((SECONDS - started)) s"
