# Shared by scripts/ab_collectives and scripts/ab_sync: the argument parsing and the build of one
# benchmark at two commits (each in build-ab/<sha>/ from a git worktree build-ab/src-<sha>;
# Release, without CUDA, NCCL and libtorch, which the benchmarks compared do not use).
#
#   ab_parse NAME "$@"     sets runs, label, out, commits[2], extra[]
#   ab_build NAME TARGET   sets binaries[2], names[2]

ab_parse() {
  local name="$1"
  shift
  runs=3
  label=ab
  out=""
  commits=()
  extra=()
  while (($#)); do
    case "$1" in
      --runs) runs="$2"; shift 2 ;;
      --label) label="$2"; shift 2 ;;
      --out) out="$2"; shift 2 ;;
      --) shift; extra=("$@"); break ;;
      -*) echo "$name: unknown option $1" >&2; exit 2 ;;
      *) commits+=("$1"); shift ;;
    esac
  done
  ((${#commits[@]} == 2)) || { echo "$name: give two commits" >&2; exit 2; }
  [[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "$name: --runs must be a positive number" >&2; exit 2; }
  mkdir -p build-ab
  out="${out:-build-ab/$label.jsonl}"
}

ab_build() {
  local name="$1" target="$2" commit sha tree
  binaries=()
  names=()
  for commit in "${commits[@]}"; do
    sha=$(git rev-parse --short=7 --verify "$commit^{commit}") ||
      { echo "$name: no commit $commit" >&2; exit 2; }
    tree="build-ab/src-$sha"
    if [[ ! -d $tree ]]; then git worktree add --detach "$tree" "$sha" >/dev/null; fi
    echo "$name: building $target at $sha" >&2
    cmake -S "$tree" -B "build-ab/$sha" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DPULSELOCO_WITH_CUDA=OFF -DPULSELOCO_WITH_NCCL=OFF -DPULSELOCO_WITH_TORCH=OFF >/dev/null
    cmake --build "build-ab/$sha" --target "$target" \
      --parallel "${PULSELOCO_BUILD_JOBS:-$(nproc)}" >/dev/null
    binaries+=("build-ab/$sha/bin/$target")
    names+=("$sha")
  done
}
