//! The command line: bad configuration stops start-up with one clear message,
//! every flag has an environment variable, and `--help` explains them.

use std::process::Command;

fn run(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_seathold"));
    cmd.args(args).env_remove("SEATHOLD_REDIS_NODES");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run seathold");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// Arguments, environment, and a word the error message must contain.
type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);

#[test]
fn bad_configuration_stops_start_up_with_a_clear_message() {
    let cases: &[Case] = &[
        (
            &["serve", "--listen", "127.0.0.1:0"],
            &[],
            "no Redis seed nodes",
        ),
        (
            &["--redis-nodes", "not a url", "--listen", "127.0.0.1:0"],
            &[],
            "not a url",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--default-ttl-ms",
                "9000",
                "--max-ttl-ms",
                "8000",
            ],
            &[],
            "--default-ttl-ms",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--max-ttl-ms",
                "9000000",
            ],
            &[],
            "--max-hold-lifetime-ms",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--key-prefix",
                "a{b}:",
            ],
            &[],
            "braces",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--confirm-wait-timeout-ms",
                "5000",
            ],
            &[],
            "--redis-timeout-ms",
        ),
        (
            &["--listen", "127.0.0.1:0"],
            &[
                ("SEATHOLD_REDIS_NODES", "redis://127.0.0.1:1"),
                ("SEATHOLD_MAX_SEATS_PER_HOLD", "0"),
            ],
            "--max-seats-per-hold",
        ),
        (&["--default-ttl-ms", "soon"], &[], "invalid value"),
    ];
    for (args, env, needle) in cases {
        let (code, text) = run(args, env);
        assert_eq!(
            code,
            Some(2),
            "{args:?} {env:?} should fail start-up:\n{text}"
        );
        assert!(
            text.contains(needle),
            "{args:?}: message should mention {needle:?}:\n{text}"
        );
        assert!(
            text.lines().filter(|l| !l.trim().is_empty()).count() <= 4,
            "one clear message, not a dump:\n{text}"
        );
    }
}

#[test]
fn help_names_every_flag_and_its_environment_variable() {
    let (code, help) = run(&["serve", "--help"], &[]);
    assert_eq!(code, Some(0));
    for (flag, env) in [
        ("--listen", "SEATHOLD_LISTEN"),
        ("--redis-nodes", "SEATHOLD_REDIS_NODES"),
        ("--redis-username", "SEATHOLD_REDIS_USERNAME"),
        ("--redis-password", "SEATHOLD_REDIS_PASSWORD"),
        ("--key-prefix", "SEATHOLD_KEY_PREFIX"),
        ("--default-ttl-ms", "SEATHOLD_DEFAULT_TTL_MS"),
        ("--max-ttl-ms", "SEATHOLD_MAX_TTL_MS"),
        ("--max-hold-lifetime-ms", "SEATHOLD_MAX_HOLD_LIFETIME_MS"),
        ("--max-seats-per-hold", "SEATHOLD_MAX_SEATS_PER_HOLD"),
        ("--confirm-wait-replicas", "SEATHOLD_CONFIRM_WAIT_REPLICAS"),
        (
            "--confirm-wait-timeout-ms",
            "SEATHOLD_CONFIRM_WAIT_TIMEOUT_MS",
        ),
        ("--redis-timeout-ms", "SEATHOLD_REDIS_TIMEOUT_MS"),
        ("--shutdown-drain-ms", "SEATHOLD_SHUTDOWN_DRAIN_MS"),
        ("--log-format", "SEATHOLD_LOG_FORMAT"),
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
        assert!(help.contains(env), "--help lacks {env}");
    }
    let (code, help) = run(&["dev", "--help"], &[]);
    assert_eq!(code, Some(0));
    assert!(
        help.contains("--masters") && help.contains("--listen"),
        "{help}"
    );
}
