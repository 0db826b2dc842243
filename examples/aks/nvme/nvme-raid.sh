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
# It never writes to a disk that is mounted (in the pod or on the host), partitioned, held by
# another device (md, dm), open exclusively by anything else, or that carries any signature but
# this array's own (a partition table included): it leaves it out, or stops with an error. Something
# else mounted at NVME_MOUNT is an error too, never mounted over. NVME_MOUNT is compared in one
# spelling, `realpath -m`'s: "/mnt/nvme/" or a path through a symlink is the same mount point.
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
# mount, umount, wipefs, chattr) instead of running them; probing (sysfs, blkid, the mount tables,
# the exclusive open) still runs. Both runs follow one plan (plan_setup), so the dry run prints what
# the real run does; the one thing it cannot see is inside an array not assembled yet, which the
# real run checks after mdadm and stops on when it is not what the plan expects.
#
# Two mount tables: PROC_MOUNTS, the pod's own (/proc/mounts format), says what NVME_MOUNT holds (a
# path in the pod; the DaemonSet's Bidirectional volume shows the pod every host mount under the
# host's /mnt); HOST_MOUNTINFO, the host's (mountinfo format), says which disks are in use on the
# host anywhere, /mnt or not: the DaemonSet reads it through a hostPath volume of the host's /proc
# (/host/proc/1/mountinfo, the mount table of the host's init). Its default, /proc/1/mountinfo, is the
# host's own when the script runs on the host. SYS_BLOCK, DEV_DIR, PROC_MOUNTS and HOST_MOUNTINFO
# point it at another tree (tests/test_examples.py runs it against a fake /sys/block).
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
HOST_MOUNTINFO=${HOST_MOUNTINFO:-/proc/1/mountinfo}
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

# The mount tables write a space, tab, newline or backslash in a path as an octal escape (\040).
AWK_UNESCAPE='
function unescape(s,   out) {
    out = ""
    while (match(s, /\\[0-7][0-7][0-7]/)) {
        out = out substr(s, 1, RSTART - 1) sprintf("%c", substr(s, RSTART + 1, 1) * 64 + substr(s, RSTART + 2, 1) * 8 + substr(s, RSTART + 3, 1))
        s = substr(s, RSTART + 4)
    }
    return out s
}'

# The device mounted at a path (the canonical NVME_MOUNT: the table holds canonical paths), from
# the pod's mount table ("" when nothing is; the last, the one on top, when mounts are stacked).
mounted_at() {
    awk -v mp="$1" "$AWK_UNESCAPE"'unescape($2) == mp { dev = unescape($1) } END { print dev }' "$PROC_MOUNTS"
}

# MOUNTED_WHERE: where a disk or one of its partitions is mounted, in the pod or on the host; ""
# when it is not. On the host by device number, the only name the host's table gives reliably (the
# source is whatever path mount was given), and as a device node bound elsewhere: a volumeMode
# Block volume is a bind mount of /dev/X (devtmpfs, root /X) under /var/lib/kubelet, no mount of
# a filesystem on X, and its pod may well open X without O_EXCL.
MOUNTED_WHERE=""
disk_is_mounted() {
    local name=$1 path=$SYS_BLOCK/$1 numbers="" part
    MOUNTED_WHERE=$(awk -v d="$DEV_DIR/$name" "$AWK_UNESCAPE"'
        { src = unescape($1) }
        src == d || index(src, d "p") == 1 { print "in the pod at " unescape($2); exit }' "$PROC_MOUNTS")
    [ -z "$MOUNTED_WHERE" ] || return 0
    for part in "$path" "$path/${name}"p*; do
        [ -e "$part/dev" ] || continue
        numbers+=" $(cat "$part/dev")"
    done
    [ -n "$numbers" ] || die "$path/dev: no device number"
    MOUNTED_WHERE=$(awk -v numbers="$numbers " -v name="$name" "$AWK_UNESCAPE"'
        {
            for (i = 7; i < NF && $i != "-"; i++) {}  # optional fields end with "-"
            root = unescape($4)
        }
        index(numbers, " " $3 " ") || ($(i + 1) == "devtmpfs" && (root == "/" name || root ~ ("^/" name "p[0-9]+$"))) {
            print "on the host at " unescape($5); exit
        }' "$HOST_MOUNTINFO")
    [ -n "$MOUNTED_WHERE" ]
}

# Whether another opener holds a disk exclusively (EXCL_ERROR: what the open said): Linux refuses
# an O_EXCL open of a block device (EBUSY) while a filesystem, md, dm, swap or any other exclusive
# opener holds it, even one that left no signature, no holder and no mount to see. Any other
# failure stops the script: a disk that cannot be checked is not taken for a free one. perl-base
# is essential in Debian and Ubuntu (the DaemonSet's image has it), and its Fcntl has O_EXCL; bash
# and coreutils have no such open.
EXCL_ERROR=""
held_exclusively() {
    local dev=$1 rc=0
    [ -e "$dev" ] || die "$dev does not exist"
    EXCL_ERROR=$(perl -MFcntl -e 'sysopen(my $fh, $ARGV[0], O_RDONLY | O_EXCL) and exit 0;
        print STDERR "$!\n"; exit($!{EBUSY} ? 1 : 2)' "$dev" 2>&1) || rc=$?
    case $rc in
        0) return 1 ;;
        1) return 0 ;;
        *) die "cannot open $dev exclusively: ${EXCL_ERROR:-perl exit $rc}" ;;
    esac
}

# blkid's low-level probe of one device into TYPE and LABEL ("" for a blank device). Called as a
# statement, never inside a condition, so that a failed probe stops the script. A partition table
# is a signature too: blkid gives it as PTTYPE alone (no TYPE) for a disk whose partitions the kernel
# has not listed, or an empty table; TYPE then names it, so that the disk is never taken as blank.
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
    if [ -z "$TYPE" ]; then
        TYPE=$(sed -n 's/^PTTYPE=\(.*\)/\1 partition table/p' <<<"$out" | head -n 1)
    fi
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
            log "skip $name: mounted $MOUNTED_WHERE"
        elif held_exclusively "$DEV_DIR/$name"; then
            log "skip $name: in use, an exclusive open fails ($EXCL_ERROR)"
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

# What setup does, decided by probing alone, the same in a dry run and a real one: STEP is
# "mounted" (nothing to do), "mount" (the filesystem is there), "assemble" (this array's members,
# not assembled), "create" (blank disks) or "format" (one blank disk); DEV is the device it mounts
# and MEMBERS the disks of the array it assembles or creates.
STEP="" DEV="" MEMBERS=()
plan_setup() {
    STEP="" DEV="" MEMBERS=()
    case $NVME_FS in
        xfs | ext4) ;;
        *) die "NVME_FS=$NVME_FS: xfs or ext4" ;;
    esac
    check_mount_point
    if [ -n "$CURRENT" ]; then
        STEP=mounted DEV=$CURRENT
        return 0
    fi
    read_disks
    find_filesystem
    if [ -n "$FOUND" ]; then
        STEP=mount DEV=$FOUND
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
        STEP=assemble DEV=$ARRAY MEMBERS=("${members[@]}")
        return 0
    fi
    [ "${#foreign[@]}" -eq 0 ] \
        || die "refusing to overwrite disks that hold data: ${foreign[*]} (wipefs -a them by hand if they are scratch)"
    if [ "${#blank[@]}" -eq 1 ]; then
        STEP=format DEV=${blank[0]}
    else
        STEP=create DEV=$ARRAY MEMBERS=("${blank[@]}")
    fi
}

# After mdadm, in a real run: the array must hold what the plan expects ("ours": this array's
# filesystem; "blank": nothing), or the run stops before the next step. A dry run assembled or
# created nothing, so there is nothing to look into: it says what the real run checks.
expect() {
    local dev=$1 want=$2
    if [ "$DRY_RUN" = 1 ]; then
        if [ "$want" = ours ]; then
            log "dry run: the real run goes on only if $dev holds the filesystem labelled $NVME_LABEL"
        else
            log "dry run: the real run goes on only if the new $dev is blank"
        fi
        return 0
    fi
    probe "$dev"
    if [ "$want" = ours ]; then
        # An array whose creation stopped before mkfs, or that holds another filesystem: a person
        # decides (teardown with NVME_WIPE=1 starts it over), never mkfs over what may be data.
        [ "$TYPE" != linux_raid_member ] && [ "$LABEL" = "$NVME_LABEL" ] \
            || die "$dev holds ${TYPE:-no filesystem} without the label $NVME_LABEL: left as it is"
    else
        # Blank disks can still show, in a new array of the same layout, the filesystem of an
        # earlier array on them whose superblocks alone were erased: never formatted over.
        [ -z "$TYPE" ] || die "the new $dev holds $TYPE${LABEL:+ ($LABEL)}, from an earlier array on its disks: left as it is"
    fi
}

setup() {
    plan_setup
    case $STEP in
        mounted)
            log "$NVME_MOUNT already holds $DEV ($NVME_LABEL)"
            return 0
            ;;
        assemble)
            run mdadm --assemble "$ARRAY" --homehost=any "${MEMBERS[@]}"
            expect "$DEV" ours
            ;;
        create)
            run mdadm --create "$ARRAY" --name="$NVME_LABEL" --homehost=any --level=0 --metadata=1.2 \
                --raid-devices="${#MEMBERS[@]}" --run "${MEMBERS[@]}"
            expect "$DEV" blank
            ;;
    esac
    case $STEP in
        create | format) run "mkfs.$NVME_FS" -L "$NVME_LABEL" "$DEV" ;;
    esac
    mount_it "$DEV"
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
        # NVME_WIPE: the filesystem's signature inside the array as well, or a new array of the
        # same layout on these disks would show it again (and setup would not format over it).
        if [ "$NVME_WIPE" = 1 ]; then run wipefs -a "$FOUND"; fi
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
    local tools=(blkid mount umount wipefs chattr mdadm perl "mkfs.$NVME_FS") missing=() tool
    for tool in "${tools[@]}"; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    [ "${#missing[@]}" -gt 0 ] || return 0
    if [ "$NVME_APT" = 1 ]; then
        log "installing mdadm, xfsprogs, e2fsprogs (missing: ${missing[*]})"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            mdadm xfsprogs e2fsprogs util-linux perl-base >/dev/null
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
[ -r "$HOST_MOUNTINFO" ] || die "cannot read $HOST_MOUNTINFO, the host's mount table (HOST_MOUNTINFO)"
# One spelling of the mount point for every comparison: the mount tables hold canonical paths,
# and "/mnt/nvme/", "/mnt//nvme" or a path through a symlink would match nothing there; setup
# would then take a mounted NVME_MOUNT for an empty one, and mount over it.
[[ $NVME_MOUNT == /* ]] || die "NVME_MOUNT=$NVME_MOUNT is not an absolute path"
canonical=$(realpath -m -- "$NVME_MOUNT") || die "cannot resolve NVME_MOUNT=$NVME_MOUNT"
[ "$canonical" = "$NVME_MOUNT" ] || log "NVME_MOUNT=$NVME_MOUNT is $canonical"
NVME_MOUNT=$canonical
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
