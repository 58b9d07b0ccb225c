#!/bin/sh
# SPDX-License-Identifier: MIT
# t_exports.sh: the shared library exports the public API and nothing else.
# Every dynamic symbol libfsdp.so defines (functions, data, weak and unique symbols, so C++
# template instantiations count) must start with fsdp_ (not fsdp__, the internal prefix),
# and a few public functions must be there (the Gloo API in every build: a stub without Gloo;
# the safetensors API). The whole set must be tests/exports.txt, the ABI's list kept in the tree:
# an export added or removed without updating it (make update-exports) fails, naming it. The
# Debian symbols file (debian/libfsdp0.symbols, which dpkg-gensymbols checks at package build
# time) must list the same symbols.
lib="${top_builddir:-.}/.libs/libfsdp.so"
if [ ! -f "$lib" ]; then
  echo "1..0 # SKIP no shared library was built ($lib)"
  exit 0
fi
if ! command -v nm >/dev/null 2>&1; then
  echo "1..0 # SKIP nm is not installed"
  exit 0
fi
echo "1..5"
defined=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TDBRVWiu]$/ {print $3}' | sort)
bad=$(printf '%s\n' "$defined" | grep -v '^fsdp_' ; printf '%s\n' "$defined" | grep '^fsdp__')
if [ -z "$bad" ]; then
  echo "ok 1 - every exported symbol is public API (fsdp_*)"
else
  echo "not ok 1 - symbols leak from libfsdp.so"
  printf '%s\n' "$bad" | sed 's/^/#   /'
fi
missing=
for s in fsdp_strerror fsdp_pg_all_gather fsdp_sim_run fsdp_store_create_memory fsdp_ctx_create \
         fsdp_store_create_file fsdp_store_create_redis fsdp_store_open_url \
         fsdp_launch_env_read fsdp_launch_env_parse \
         fsdp_pg_create_gloo fsdp_gloo_options_init fsdp_gloo_available \
         fsdp_pg_create_nccl fsdp_nccl_options_init fsdp_nccl_available fsdp_nccl_device \
         fsdp_dataset_open fsdp_dataset_view fsdp_dataset_split fsdp_dataset_destroy \
         fsdp_dataset_num_tokens fsdp_dataset_format fsdp_dataset_path fsdp_dataset_max_token \
         fsdp_dataset_read fsdp_data_default_corpus \
         fsdp_loader_options_init fsdp_loader_create fsdp_loader_destroy fsdp_loader_options \
         fsdp_loader_rows fsdp_loader_num_batches fsdp_loader_get_position \
         fsdp_loader_set_position fsdp_loader_batch fsdp_loader_next fsdp_loader_next_tensors \
         fsdp_loader_last_error \
         fsdp_safetensors_open fsdp_safetensors_close fsdp_safetensors_last_error \
         fsdp_safetensors_count fsdp_safetensors_info fsdp_safetensors_find \
         fsdp_safetensors_metadata_count fsdp_safetensors_metadata_at fsdp_safetensors_metadata \
         fsdp_safetensors_read_raw fsdp_safetensors_read fsdp_safetensors_read_tensor \
         fsdp_safetensors_load_tensor fsdp_safetensors_load_all fsdp_safetensors_load_into \
         fsdp_safetensors_load_module fsdp_safetensors_save fsdp_safetensors_save_module \
         fsdp_gpt2_hf_name fsdp_gpt2_name_from_hf fsdp_gpt2_hf_is_conv1d fsdp_gpt2_hf_save \
         fsdp_gpt2_hf_load fsdp_gpt_recipe_adamw_options_init fsdp_gpt_recipe_decays \
         fsdp_gpt_recipe_create_model fsdp_gpt_recipe_wrap fsdp_gpt_recipe_create_adamw; do
  printf '%s\n' "$defined" | grep -qx "$s" || missing="$missing $s"
done
if [ -z "$missing" ]; then
  echo "ok 2 - public functions are exported"
else
  echo "not ok 2 - missing exports:$missing"
fi
count=$(printf '%s\n' "$defined" | grep -c '^fsdp_')
if [ "$count" -ge 50 ]; then
  echo "ok 3 - $count public symbols exported"
else
  echo "not ok 3 - only $count public symbols exported"
fi
list="${srcdir:-.}/tests/exports.txt"
if [ ! -f "$list" ]; then
  echo "not ok 4 - no list of exports at $list"
else
  added=$(printf '%s\n' "$defined" | grep . | LC_ALL=C sort | LC_ALL=C comm -23 - "$list" | tr '\n' ' ')
  removed=$(printf '%s\n' "$defined" | grep . | LC_ALL=C sort | LC_ALL=C comm -13 - "$list" | tr '\n' ' ')
  if [ -z "$added$removed" ]; then
    echo "ok 4 - the exports are tests/exports.txt's $(grep -c . "$list")"
  else
    echo "not ok 4 - the exports differ from tests/exports.txt (an ABI change: update it with make update-exports, and the soname if anything was removed)"
    [ -n "$added" ] && echo "#   added: $added"
    [ -n "$removed" ] && echo "#   removed: $removed"
  fi
fi
sym="${srcdir:-.}/debian/libfsdp0.symbols"
if [ ! -f "$sym" ] || [ ! -f "$list" ]; then
  echo "not ok 5 - no Debian symbols file at $sym"
else
  diff=$(sed -n 's/^ \([^ ]*\)@Base .*/\1/p' "$sym" | LC_ALL=C sort | diff - "$list" | grep '^[<>]' | tr '\n' ' ')
  if [ -z "$diff" ] && head -1 "$sym" | grep -q '^libfsdp.so.0 libfsdp0 '; then
    echo "ok 5 - debian/libfsdp0.symbols lists the same $(grep -c @Base "$sym") symbols for libfsdp.so.0"
  else
    echo "not ok 5 - debian/libfsdp0.symbols and tests/exports.txt differ (make update-exports)"
    echo "#   $diff"
  fi
fi
