# Sourced by scripts/debian-base-image.sh and scripts/image-check.sh: Podman and what it needs
# beside it as Debian packages, installed with apt when any is missing (a re-run after a failed
# install mends itself). `--no-install-recommends` leaves out two that Podman recommends and the
# check needs: runc (the runtime the check's containers.conf names) and catatonit (the pause
# binary `podman kube play` builds its local pause image from: without it every pod fails with
# 'finding pause binary: exec: "catatonit": executable file not found in $PATH').
PODMAN_PACKAGES=(podman runc catatonit)

PODMAN_HELPERS=${PODMAN_HELPERS:-/usr/libexec/podman}    # where Debian's Podman finds catatonit

# missing_podman_packages: the packages of PODMAN_PACKAGES whose program is not installed, one
# per line (catatonit may be only in Podman's helper folder, not on the PATH).
missing_podman_packages() {
  command -v podman >/dev/null 2>&1 || echo podman
  command -v runc >/dev/null 2>&1 || echo runc
  command -v catatonit >/dev/null 2>&1 || [ -x "$PODMAN_HELPERS/catatonit" ] || echo catatonit
}

# install_podman_packages WHO: install what missing_podman_packages names, with apt as root, or
# say what to install and return 1.
install_podman_packages() {
  local who=$1 missing
  mapfile -t missing < <(missing_podman_packages)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "$who: installing ${missing[*]} with apt" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    return 0
  fi
  echo "$who: needs ${missing[*]}: e.g. 'sudo apt-get install -y ${PODMAN_PACKAGES[*]}'" >&2
  return 1
}
