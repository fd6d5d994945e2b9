#!/usr/bin/env bash
# Build the fluxjoin image: scripts/build-image.sh [tag]   (default fluxjoin:dev)
#
# Where the machine trusts extra CA certificates (a network that inspects TLS), the build stage gets them
# too (build arg EXTRA_CA_CERTS), so pip inside the build reaches PyPI as the host does.
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-fluxjoin:dev}"
extra=""
shopt -s nullglob
for cert in /usr/local/share/ca-certificates/*.crt; do
  extra+="$(cat "$cert")"$'\n'
done
exec docker build --build-arg EXTRA_CA_CERTS="$extra" -t "$tag" .
