# Checks of the numbers the launch scripts take from the environment and the command line.
# Sourced by scripts/*.sh and scripts/slurm_common.sh; defines functions only.
#
# Bash evaluates a variable's value as an arithmetic expression in $(( )), (( )) and
# [[ -gt ]], and such an expression can run a command: NPROC_PER_NODE='HOME[$(touch /tmp/x)]'
# would run `touch` at the first `$(( cores / NPROC_PER_NODE ))`. So every such number goes
# through cp_ext_int first: digits only, within bounds, else one message naming the variable
# and its fix, and exit 2. After the check the value is a plain decimal, safe in arithmetic.

# cp_ext_int NAME DEFAULT MIN MAX FIX [LABEL]
#   NAME     a variable (environment knob or the script's own); unset or empty: DEFAULT
#   DEFAULT  the value when NAME is unset or empty; "" makes NAME required
#   MIN MAX  bounds (MAX "": none; at most 9 digits in any case)
#   FIX      the sentence telling the user what to do, printed after the error
#   LABEL    what the message calls the value (default: NAME), e.g. a flag's name
# On success NAME is set to the value without leading zeros (010 is 10, not octal 8) and
# keeps its export attribute. On failure:
#   error: LABEL must be an integer >= MIN (plain digits, at most 9; got 'VALUE'); FIX
#   on stderr, and exit 2.
cp_ext_int() {
    local _cpx_name="$1" _cpx_default="$2" _cpx_min="$3" _cpx_max="$4" _cpx_fix="$5" _cpx_label="${6:-$1}"
    local _cpx_value="${!_cpx_name:-}" _cpx_from=""
    if [[ -z "$_cpx_value" && -n "$_cpx_default" ]]; then
        _cpx_value="$_cpx_default" _cpx_from=", the default"
    fi
    if [[ "$_cpx_value" =~ ^[0-9]+$ ]]; then
        local _cpx_digits="${_cpx_value#"${_cpx_value%%[!0]*}"}"  # the string minus its leading zeros
        _cpx_digits="${_cpx_digits:-0}"
        if [[ ${#_cpx_digits} -le 9 && "$_cpx_digits" -ge "$_cpx_min" ]] \
            && [[ -z "$_cpx_max" || "$_cpx_digits" -le "$_cpx_max" ]]; then
            printf -v "$_cpx_name" '%s' "$_cpx_digits"
            return 0
        fi
    fi
    local _cpx_range="an integer >= $_cpx_min"
    [[ -n "$_cpx_max" ]] && _cpx_range="an integer from $_cpx_min to $_cpx_max"
    printf "error: %s must be %s (plain digits, at most 9; got '%s'%s); %s\n" \
        "$_cpx_label" "$_cpx_range" "$_cpx_value" "$_cpx_from" "$_cpx_fix" >&2
    exit 2
}

# cp_ext_timeout_minutes CONFIG [pretrain_moe.py flags...]
#   The run's --distributed-timeout-minutes, checked (an integer >= 1), in CP_EXT_TIMEOUT_MINUTES;
#   CP_EXT_TIMEOUT_FLAGS is what the launcher adds to pretrain_moe.py's command line.
#   Precedence as pretrain_moe.py's: the last --distributed-timeout-minutes N (or =N) among the
#   flags (nothing added), else $DISTRIBUTED_TIMEOUT_MINUTES (added as the flag), else a
#   top-level `distributed-timeout-minutes: N` in CONFIG (nothing added), else 10 (the
#   flag's default; nothing added).
cp_ext_timeout_minutes() {
    local config="$1" flag="--distributed-timeout-minutes" from="" value="" line
    shift
    CP_EXT_TIMEOUT_FLAGS=()
    while [[ $# -gt 0 ]]; do
        case "$1" in
            "$flag") value="${2:-}" from="flag"; shift ;;
            "$flag="*) value="${1#*=}" from="flag" ;;
        esac
        shift
    done
    if [[ -n "${DISTRIBUTED_TIMEOUT_MINUTES:-}" ]]; then  # checked when set, even where a flag wins
        cp_ext_int DISTRIBUTED_TIMEOUT_MINUTES "" 1 "" \
            "set DISTRIBUTED_TIMEOUT_MINUTES to whole minutes (e.g. 30) or unset it (pretrain_moe.py's default, 10)"
    fi
    if [[ -n "$from" ]]; then
        CP_EXT_TIMEOUT_MINUTES="$value"
        cp_ext_int CP_EXT_TIMEOUT_MINUTES "" 1 "" \
            "give it whole minutes, e.g. $flag 30" "$flag"
        return 0
    fi
    if [[ -n "${DISTRIBUTED_TIMEOUT_MINUTES:-}" ]]; then
        CP_EXT_TIMEOUT_MINUTES="$DISTRIBUTED_TIMEOUT_MINUTES"
        CP_EXT_TIMEOUT_FLAGS=("$flag" "$CP_EXT_TIMEOUT_MINUTES")
        return 0
    fi
    CP_EXT_TIMEOUT_MINUTES=10
    if [[ -f "$config" ]]; then
        line="$(grep -E '^-{0,2}distributed[-_]timeout[-_]minutes[[:space:]]*:' "$config" | tail -n1 || true)"
        if [[ -n "$line" ]]; then
            line="${line#*:}" line="${line%%#*}"                  # the value, minus a comment
            line="${line#"${line%%[![:space:]]*}"}" line="${line%"${line##*[![:space:]]}"}"  # trimmed
            CP_EXT_TIMEOUT_MINUTES="$line"
            cp_ext_int CP_EXT_TIMEOUT_MINUTES "" 1 "" \
                "write whole minutes there, e.g. distributed-timeout-minutes: 30" \
                "distributed-timeout-minutes in $config"
        fi
    fi
}
