#!/usr/bin/env bash
# Prints the git tree id of this working copy as it is (tracked and new files, .gitignore applied),
# without touching the index: a CUDA host's copy of a tree may carry an older .git, so its
# `git log -1` need not name the commit the files are from. Find that commit with
#   git log --all --format='%h %T' | grep TREE_ID
cd "$(dirname "$0")/.." || exit 1
idx=$(mktemp) || exit 1
trap 'rm -f "$idx"' EXIT
cp .git/index "$idx" 2>/dev/null
export GIT_INDEX_FILE=$idx
{ git add -A && git rm -r -q --cached --ignore-unmatch .whl var && git write-tree; } 2>/dev/null || echo unknown
