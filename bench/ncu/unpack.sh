#!/usr/bin/env bash
# Makes the staged executable .gpu/bin/$1 ready: as staged, or unpacked from the first
# .gpu/*/$1.xz (compressed to fit the device tool's carry).
set -u
[ -x ".gpu/bin/$1" ] && exit 0
for packed in .gpu/*/"$1".xz; do
  [ -f "$packed" ] || continue
  mkdir -p .gpu/bin && xz -dc "$packed" > ".gpu/bin/$1" && chmod +x ".gpu/bin/$1" && exit 0
done
echo "unpack.sh: no staged executable $1 (.gpu/bin/$1 or .gpu/*/$1.xz)" >&2
exit 2
