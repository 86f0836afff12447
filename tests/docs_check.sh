#!/usr/bin/env bash
# Checks that the documentation holds together:
#  - every relative link in README.md and docs/*.md resolves: the file or
#    folder exists inside SOURCE_DIR, and a #anchor names a heading of the
#    Markdown file it points into, as GitHub makes heading anchors (lowercase,
#    spaces to '-', punctuation other than '-' and '_' dropped, "-1", "-2", ...
#    after repeats; characters outside ASCII are dropped too);
#  - with SERVER_BIN: every flag `SERVER_BIN --help` prints is a row of the
#    flags table in docs/serving.md (the table whose first column is "flag"),
#    and that table lists no flag the binary does not print.
# Links inside code (fenced blocks, `spans`) and to URLs (http:, mailto:, ...)
# are not checked. Only Bash, grep, sed and awk: it runs on a fresh Debian.
#
# Usage: tests/docs_check.sh SOURCE_DIR [SERVER_BIN]
set -euo pipefail
export LC_ALL=C
src=${1:?usage: $0 SOURCE_DIR [SERVER_BIN]}
bin=${2:-}
src=$(cd "$src" && pwd)

failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# The anchors GitHub gives the headings of Markdown file $1, one a line.
anchors() {
  awk '
    /^ *(```|~~~)/ { code = !code; next }
    code || !/^#+ / || !match($0, /^#+/) || RLENGTH > 6 { next }
    {
      h = $0
      sub(/^#+ +/, "", h); sub(/ +#* *$/, "", h)
      gsub(/!?\[/, "", h); gsub(/\]\([^)]*\)/, "", h)   # [text](url) -> text
      h = tolower(h)
      gsub(/[^a-z0-9 _-]/, "", h)
      gsub(/ /, "-", h)
      n = seen[h]++
      print (n ? h "-" n : h)
    }
  ' "$1"
}

# "LINE<TAB>TARGET" for every inline link of Markdown file $1 outside code.
links() {
  awk '
    /^ *(```|~~~)/ { code = !code; next }
    code { next }
    {
      s = $0
      gsub(/`[^`]*`/, "", s)
      while (match(s, /\]\([^) ]*( "[^"]*")?\)/)) {
        t = substr(s, RSTART + 2, RLENGTH - 3)
        sub(/ .*/, "", t)
        print NR "\t" t
        s = substr(s, RSTART + RLENGTH)
      }
    }
  ' "$1"
}

docs=("$src/README.md")
for f in "$src"/docs/*.md; do [[ -e $f ]] && docs+=("$f"); done
[[ -d $src/docs ]] || fail "docs/: no such folder in $src"

checked=0
declare -A heading_anchors
for doc in "${docs[@]}"; do
  rel_doc=${doc#"$src"/}
  dir=$(dirname "$doc")
  while IFS=$'\t' read -r line target; do
    [[ -z $target || $target =~ ^[A-Za-z][A-Za-z0-9+.-]*: ]] && continue
    checked=$((checked + 1))
    path=${target%%#*}
    anchor=
    [[ $target == *#* ]] && anchor=${target#*#}
    if [[ -z $path ]]; then
      file=$doc
    else
      file=$(realpath -m "$dir/$path")
      if [[ $file != "$src" && $file != "$src"/* ]]; then
        fail "$rel_doc:$line: link ($target) leaves the repository"
        continue
      fi
      if [[ ! -e $file ]]; then
        fail "$rel_doc:$line: link ($target): ${file#"$src"/} does not exist"
        continue
      fi
    fi
    [[ -z $anchor ]] && continue
    if [[ $file != *.md ]]; then
      # GitHub's line anchors into a source file, and nothing else.
      [[ $anchor =~ ^L[0-9]+(-L[0-9]+)?$ ]] ||
        fail "$rel_doc:$line: link ($target): #$anchor points into a file that is not Markdown"
      continue
    fi
    [[ -v heading_anchors[$file] ]] || heading_anchors[$file]=$(anchors "$file")
    if ! grep -qxF -- "$anchor" <<<"${heading_anchors[$file]}"; then
      fail "$rel_doc:$line: link ($target): no heading of ${file#"$src"/} has the anchor #$anchor"
    fi
  done < <(links "$doc")
done
echo "docs_check: $checked relative links in ${#docs[@]} files"

if [[ -n $bin ]]; then
  name=$(basename "$bin")
  table=$src/docs/serving.md
  # Abseil exits 1 after printing help; what it printed is what counts.
  help=$("$bin" --help 2>&1 || true)
  mapfile -t printed < <(sed -n 's/^    --\([A-Za-z0-9_]*\) (.*/\1/p' <<<"$help" | sort -u)
  if [[ ${#printed[@]} -eq 0 ]]; then
    fail "$name --help printed no flag in the form '--name (meaning); default: ...;':"
    echo "$help" >&2
  fi
  # The first column of the table whose header's first cell is "flag".
  mapfile -t documented < <(
    awk -F'|' '
      !/^ *\|/ { in_table = 0; flags = 0; next }
      !in_table { in_table = 1; c = $2; gsub(/[ `]/, "", c); flags = (c == "flag"); next }
      flags { print $2 }
    ' "$table" 2>/dev/null | grep -oE -- '--[A-Za-z0-9_]+' | sed 's/^--//' | sort -u || true)
  if [[ ${#documented[@]} -eq 0 ]]; then
    fail "docs/serving.md has no flags table (a table whose first column is \"flag\")"
  fi
  missing=$(comm -23 <(printf '%s\n' "${printed[@]}") <(printf '%s\n' "${documented[@]}"))
  extra=$(comm -13 <(printf '%s\n' "${printed[@]}") <(printf '%s\n' "${documented[@]}"))
  for flag in $missing; do
    fail "$name --help prints --$flag, which the flags table of docs/serving.md does not list"
  done
  for flag in $extra; do
    fail "docs/serving.md's flags table lists --$flag, which $name --help does not print"
  done
  echo "docs_check: $name --help prints ${#printed[@]} flags; docs/serving.md's table lists ${#documented[@]}"
fi

if [[ $failures -gt 0 ]]; then
  echo "docs_check: $failures problem(s)" >&2
  exit 1
fi
echo "PASS: docs_check"
