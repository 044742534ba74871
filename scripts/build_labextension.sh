#!/usr/bin/env bash
# Builds gpucleanup's prebuilt JupyterLab 4 extension from labextension/ into
# share/jupyter/labextensions/gpucleanup/ (committed; the wheel ships it), with Debian's webpack and Node only:
# no npm registry, no @jupyterlab package on disk (every one is taken from JupyterLab's share scope at run time).
# Installs what it needs (as root): Debian's nodejs 18 and webpack 5.75 (share/FACTS.md, JupyterLab extension).
# --install-only: installs them and builds nothing (scripts/setup.sh: the stale-build test needs webpack).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "build_labextension: $*"; }
if ! command -v webpack >/dev/null || ! node -e 'require("webpack")' 2>/dev/null; then
  say "installing Debian's nodejs and webpack"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --allow-downgrades "nodejs=18.*" webpack >/dev/null
fi
[ "${1:-}" != --install-only ] || exit 0
out=share/jupyter/labextensions/gpucleanup
rm -rf "$out"
mkdir -p "$out/static"
NODE_PATH=/usr/share/nodejs GPUCLEANUP_LAB_OUT="$PWD/$out/static" webpack --config labextension/webpack.config.js >/dev/null
entry=$(cd "$out/static" && ls remoteEntry.*.js)
# the settings' schema, where JupyterLab reads a prebuilt extension's: schemas/<package name>/<plugin>.json
mkdir -p "$out/schemas/gpucleanup"
cp labextension/schema/*.json "$out/schemas/gpucleanup/"
python3 - "$out" "$entry" <<'PY'
import json, pathlib, sys
out, entry = pathlib.Path(sys.argv[1]), sys.argv[2]
meta = json.loads(pathlib.Path("labextension/package.json").read_text())
meta["jupyterlab"]["_build"] = {"load": f"static/{entry}", "extension": "./extension"}
(out / "package.json").write_text(json.dumps(meta, indent=2) + "\n")
PY
say "built $out ($(ls "$out/static" | wc -l) files, $entry)"
