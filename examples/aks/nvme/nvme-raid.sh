#!/bin/bash
# Prepare a GPU node's local NVMe for azcp-cluster: one RAID 0 of the VM's local NVMe disks (or the
# one disk, as it is), formatted and mounted at NVME_MOUNT. Run by the DaemonSet in daemonset.yaml,
# once per node start; idempotent:
#
#   - NVME_MOUNT already holds the filesystem labelled NVME_LABEL: nothing to do;
#   - that filesystem exists (an array the host assembled at boot, or the single disk): mount it;
#   - the local disks carry this array's RAID superblocks (a reboot without an assembled array):
#     assemble them, then mount;
#   - every local disk is blank (a new VM, or one after deallocation, which wipes the local NVMe):
#     create the array and the filesystem, then mount.
#
# It never writes to a disk that is mounted, partitioned, held by another device (md, dm), or that
# carries any signature but this array's own: it stops with an error instead. Something else
# mounted at NVME_MOUNT is an error too, never mounted over.
#
#   nvme-raid.sh setup      create, assemble, mount (above)
#   nvme-raid.sh teardown   unmount NVME_MOUNT and stop the array; the data stays on the disks
#                           (setup finds it again) unless NVME_WIPE=1, which erases the RAID
#                           superblocks and the filesystem signature
#   nvme-raid.sh plan       list the disks it would use and why it leaves the others out
#
# A second argument "stay" (the DaemonSet's) then writes NVME_DONE_FILE (its readiness probe) and
# sleeps for good. NVME_APT=1 installs mdadm and xfsprogs with apt-get first when they are missing.
#
# DRY_RUN=1 prints the commands that change anything (mdadm --create/--assemble/--stop, mkfs,
# mount, umount, wipefs, chattr) instead of running them; probing (sysfs, blkid, the mount table)
# still runs. SYS_BLOCK, DEV_DIR and PROC_MOUNTS point it at another tree (tests/test_examples.py
# runs it against a fake /sys/block).
set -euo pipefail
shopt -s inherit_errexit

NVME_MOUNT=${NVME_MOUNT:-/mnt/nvme}
NVME_LABEL=${NVME_LABEL:-azcp-nvme}              # filesystem label and md array name: the marker
NVME_MODEL=${NVME_MODEL:-Microsoft NVMe Direct Disk}  # Azure's local NVMe (NDv4, NDv5); not remote disks
NVME_FS=${NVME_FS:-xfs}
NVME_WIPE=${NVME_WIPE:-0}
SYS_BLOCK=${SYS_BLOCK:-/sys/block}
DEV_DIR=${DEV_DIR:-/dev}
PROC_MOUNTS=${PROC_MOUNTS:-/proc/mounts}
DRY_RUN=${DRY_RUN:-0}
NVME_APT=${NVME_APT:-0}
NVME_DONE_FILE=${NVME_DONE_FILE:-/tmp/azcp-nvme.done}
ARRAY=$DEV_DIR/md/$NVME_LABEL

log() { echo "[nvme] $*" >&2; }
die() { log "error: $*"; exit 1; }

run() {
    if [ "$DRY_RUN" = 1 ]; then
        echo "+ $*"
    else
        log "+ $*"
        "$@"
    fi
}

# The device mounted at a path, from the mount table ("" when nothing is).
mounted_at() {
    awk -v mp="$1" '$2 == mp { dev = $1 } END { print dev }' "$PROC_MOUNTS"
}

# Whether a disk or one of its partitions is the source of any mount.
disk_is_mounted() {
    awk -v d="$DEV_DIR/$1" '$1 == d || index($1, d "p") == 1 { found = 1 } END { exit !found }' "$PROC_MOUNTS"
}

# blkid's low-level probe of one device into TYPE and LABEL ("" for a blank device). Called as a
# statement, never inside a condition, so that a failed probe stops the script.
TYPE="" LABEL=""
probe() {
    local dev=$1 out rc=0
    # blkid answers "nothing found" for a path that does not exist: never take that for blank.
    [ -e "$dev" ] || die "$dev does not exist"
    out=$(blkid -p -o export "$dev") || rc=$?
    case $rc in
        0 | 2) ;;  # 2: no signature, a blank device
        *) die "blkid cannot probe $dev (exit $rc)" ;;
    esac
    TYPE=$(sed -n 's/^TYPE=//p' <<<"$out" | head -n 1)
    LABEL=$(sed -n 's/^LABEL=//p' <<<"$out" | head -n 1)
}

# The local NVMe disks this node may use, one per line, in name order; the others are logged.
select_disks() {
    local path name model holders
    for path in "$SYS_BLOCK"/nvme*; do
        [ -e "$path" ] || continue
        name=${path##*/}
        if ! [[ $name =~ ^nvme[0-9]+n[0-9]+$ ]]; then
            continue  # a multipath path (nvme0c0n1) or anything else that is not a namespace
        fi
        model=$(tr -s ' ' <"$path/device/model" | sed 's/ *$//') || model=""
        holders=$(compgen -G "$path/holders/*" | sed 's|.*/||' | tr '\n' ' ') || holders=""
        if [[ $model != *"$NVME_MODEL"* ]]; then
            log "skip $name: model '${model:-?}' is not '$NVME_MODEL'"
        elif [ "$(cat "$path/ro" 2>/dev/null || echo 1)" != 0 ]; then
            log "skip $name: read-only"
        elif [ "$(cat "$path/size" 2>/dev/null || echo 0)" = 0 ]; then
            log "skip $name: size 0"
        elif compgen -G "$path/${name}p*/partition" >/dev/null; then
            log "skip $name: partitioned"
        elif [ -n "$holders" ]; then
            log "skip $name: held by $holders"
        elif disk_is_mounted "$name"; then
            log "skip $name: mounted"
        else
            echo "$name"
        fi
    done | sort -V
}

DISKS=()
read_disks() {
    local out
    out=$(select_disks)
    DISKS=()
    [ -z "$out" ] || mapfile -t DISKS <<<"$out"
}

# FOUND: the device that holds this array's filesystem now (an active array, or one of the
# disks), or "".
FOUND=""
find_filesystem() {
    local path dev
    FOUND=""
    for path in "$SYS_BLOCK"/md* "${DISKS[@]/#/$SYS_BLOCK/}"; do
        [ -e "$path" ] || continue
        if [[ ${path##*/} == md* ]] && [ ! -e "$path/md" ]; then continue; fi
        dev=$DEV_DIR/${path##*/}
        probe "$dev"
        if [ "$LABEL" = "$NVME_LABEL" ] && [ "$TYPE" != linux_raid_member ]; then
            FOUND=$dev
            return 0
        fi
    done
}

mount_it() {
    local dev=$1
    if [ -z "$(mounted_at "$NVME_MOUNT")" ]; then
        run mkdir -p "$NVME_MOUNT"
        # Immutable while unmounted: a pod that mounts the directory on a node where this step
        # failed cannot write into the node's OS or temporary disk.
        run chattr +i "$NVME_MOUNT" || log "warning: could not make $NVME_MOUNT immutable"
    fi
    run mount -o noatime "$dev" "$NVME_MOUNT"
    log "mounted $dev at $NVME_MOUNT"
}

# Refuse a mount point that holds anything but this filesystem; CURRENT: what it holds, or "".
CURRENT=""
check_mount_point() {
    CURRENT=$(mounted_at "$NVME_MOUNT")
    if [ -n "$CURRENT" ]; then
        probe "$CURRENT"
        [ "$LABEL" = "$NVME_LABEL" ] \
            || die "$NVME_MOUNT holds $CURRENT, not a filesystem labelled $NVME_LABEL: left as it is"
    fi
}

setup() {
    check_mount_point
    if [ -n "$CURRENT" ]; then
        log "$NVME_MOUNT already holds $CURRENT ($NVME_LABEL)"
        return 0
    fi
    read_disks
    find_filesystem
    if [ -n "$FOUND" ]; then
        mount_it "$FOUND"
        return 0
    fi
    [ "${#DISKS[@]}" -gt 0 ] || die "no local NVMe disk to use (model '$NVME_MODEL', see the lines above)"

    local members=() blank=() foreign=() disk dev
    for disk in "${DISKS[@]}"; do
        dev=$DEV_DIR/$disk
        probe "$dev"
        if [ "$TYPE" = linux_raid_member ] && { [ "$LABEL" = "$NVME_LABEL" ] || [ "${LABEL##*:}" = "$NVME_LABEL" ]; }; then
            members+=("$dev")  # blkid gives the array's name as LABEL, with or without a host
        elif [ -z "$TYPE" ]; then
            blank+=("$dev")
        else
            foreign+=("$dev ($TYPE)")
        fi
    done

    if [ "${#members[@]}" -gt 0 ]; then
        # After a reboot that left the array unassembled: bring back what is there, never recreate.
        if [ "${#blank[@]}" -gt 0 ] || [ "${#foreign[@]}" -gt 0 ]; then
            log "not in the $NVME_LABEL array, left alone: ${blank[*]} ${foreign[*]}"
        fi
        run mdadm --assemble "$ARRAY" --homehost=any "${members[@]}"
        dev=$ARRAY
    else
        [ "${#foreign[@]}" -eq 0 ] \
            || die "refusing to overwrite disks that hold data: ${foreign[*]} (wipefs -a them by hand if they are scratch)"
        if [ "${#blank[@]}" -eq 1 ]; then
            dev=${blank[0]}
        else
            run mdadm --create "$ARRAY" --name="$NVME_LABEL" --homehost=any --level=0 --metadata=1.2 \
                --raid-devices="${#blank[@]}" --run "${blank[@]}"
            dev=$ARRAY
        fi
    fi

    # A new array or disk, or an array whose creation stopped before mkfs: make the filesystem,
    # never over another one. (A dry run created nothing: there is nothing to probe.)
    TYPE="" LABEL=""
    if [ "$DRY_RUN" != 1 ] || [ -e "$dev" ]; then
        probe "$dev"
    fi
    if [ -z "$TYPE" ]; then
        case $NVME_FS in
            xfs) run mkfs.xfs -L "$NVME_LABEL" "$dev" ;;
            ext4) run mkfs.ext4 -L "$NVME_LABEL" "$dev" ;;
            *) die "NVME_FS=$NVME_FS: xfs or ext4" ;;
        esac
    elif [ "$LABEL" != "$NVME_LABEL" ]; then
        die "$dev holds $TYPE without the label $NVME_LABEL: left as it is"
    fi
    mount_it "$dev"
}

teardown() {
    check_mount_point
    if [ -n "$CURRENT" ]; then
        # Fails while a process has files open there: run this after the jobs that use it.
        run umount "$NVME_MOUNT"
    fi
    read_disks
    find_filesystem
    local release=() slave dev
    if [[ $FOUND == "$DEV_DIR"/md* ]]; then
        for slave in "$SYS_BLOCK/${FOUND##*/}"/slaves/*; do
            [ -e "$slave" ] && release+=("$DEV_DIR/${slave##*/}")
        done
        # Refused by the kernel while the filesystem is still mounted anywhere, a pod included.
        run mdadm --stop "$FOUND"
    elif [ -n "$FOUND" ]; then
        release=("$FOUND")
    else
        for dev in "${DISKS[@]/#/$DEV_DIR/}"; do
            probe "$dev"
            if [ "$TYPE" = linux_raid_member ] && [ "${LABEL##*:}" = "$NVME_LABEL" ]; then
                release+=("$dev")
            fi
        done
    fi
    log "$NVME_LABEL released${release[*]:+: ${release[*]}}"
    if [ "$NVME_WIPE" = 1 ] && [ "${#release[@]}" -gt 0 ]; then
        run wipefs -a "${release[@]}"
    fi
}

need_tools() {
    local tools=(blkid mount umount wipefs chattr mdadm "mkfs.$NVME_FS") missing=() tool
    for tool in "${tools[@]}"; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    [ "${#missing[@]}" -gt 0 ] || return 0
    if [ "$NVME_APT" = 1 ]; then
        log "installing mdadm, xfsprogs, e2fsprogs (missing: ${missing[*]})"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            mdadm xfsprogs e2fsprogs util-linux >/dev/null
    else
        die "missing: ${missing[*]}"
    fi
}

mode=${1:-}
stay=${2:-}
case $mode in
    setup | teardown | plan) ;;
    *) echo "usage: $0 setup|teardown|plan [stay]" >&2; exit 2 ;;
esac
[ -r "$PROC_MOUNTS" ] || die "cannot read $PROC_MOUNTS"
if [ "$DRY_RUN" != 1 ] && [ "$mode" != plan ]; then need_tools; fi
rm -f "$NVME_DONE_FILE"
case $mode in
    setup) setup ;;
    teardown) teardown ;;
    plan) select_disks ;;
esac
if [ "$stay" = stay ]; then
    touch "$NVME_DONE_FILE"
    log "$mode done; sleeping"
    exec sleep infinity
fi
