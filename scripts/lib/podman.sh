# Sourced by scripts/build-images and scripts/check-kube: podman with a configuration that works
# on a plain Debian 12 machine or container host without systemd (cgroupfs cgroup manager, runc,
# no default ulimits that an unprivileged container host cannot raise), installed from
# Debian's packages when missing. The caller's own CONTAINERS_CONF wins.

podman_setup() {
  local need=()
  command -v podman >/dev/null 2>&1 || need+=(podman)
  command -v runc >/dev/null 2>&1 || need+=(runc)
  command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
  # A pod's infra container runs catatonit (podman kube play).
  [[ -x /usr/libexec/podman/catatonit || -x /usr/bin/catatonit ]] || need+=(catatonit)
  if ((${#need[@]})); then
    echo "podman: installing Debian packages: ${need[*]}" >&2
    local sudo=""
    [[ $(id -u) -ne 0 ]] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" \
      uidmap slirp4netns fuse-overlayfs >/dev/null
  fi
  if [[ -z "${CONTAINERS_CONF:-}" ]]; then
    local dir="${XDG_CACHE_HOME:-$HOME/.cache}/dualdecoder/containers"
    mkdir -p "$dir"
    cat > "$dir/containers.conf" <<'CONF'
# Written by scripts/lib/podman.sh (DualDecoder); CONTAINERS_CONF points here.
[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
CONF
    export CONTAINERS_CONF="$dir/containers.conf"
  fi
}

# The host's CA bundle (for pip behind a TLS-inspecting proxy), or nothing.
host_ca_bundle() {
  local ca
  for ca in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
    if [[ -s "$ca" ]]; then echo "$ca"; return; fi
  done
}
