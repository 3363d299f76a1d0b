//! The Lua scripts in `lua/`, embedded at build time and run by EVALSHA.
//!
//! Each script is loaded on every master at start-up (`SCRIPT LOAD`, which
//! the cluster client sends to all primaries). A node can still answer
//! `NOSCRIPT`: a replica promoted after a failover, a master added later, or
//! a `SCRIPT FLUSH`. Then the call is repeated once as `EVAL` with the body,
//! which also caches the script on that node, so the next EVALSHA succeeds.

use redis::aio::ConnectionLike;
use redis::{Cmd, FromRedisValue, RedisResult, ServerErrorKind};

/// One Lua script: its name (for logs and metrics), body and SHA1.
#[derive(Debug, Clone)]
pub struct Script {
    name: &'static str,
    body: &'static str,
    sha: String,
}

impl Script {
    fn new(name: &'static str, body: &'static str) -> Self {
        Self {
            name,
            body,
            sha: redis::Script::new(body).get_hash().to_owned(),
        }
    }

    /// The script's file name without `.lua`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The script's source.
    pub fn body(&self) -> &'static str {
        self.body
    }

    /// Runs the script with `keys` and the arguments that `args` appends,
    /// by EVALSHA, falling back to EVAL once on `NOSCRIPT`.
    ///
    /// `args` is a function rather than a list so that the arguments are
    /// written straight into the command, and written again only on the
    /// rare fallback.
    pub async fn run<C, T, K>(
        &self,
        con: &mut C,
        keys: &[K],
        args: impl Fn(&mut Cmd),
    ) -> RedisResult<T>
    where
        C: ConnectionLike + Send,
        T: FromRedisValue,
        K: AsRef<[u8]>,
    {
        match self.command("EVALSHA", keys, &args).query_async(con).await {
            Err(err) if err.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript) => {
                tracing::info!(
                    script = self.name,
                    "NOSCRIPT from Redis; sending the script body with EVAL"
                );
                metrics::counter!(crate::metrics::SCRIPT_RELOADS, "script" => self.name)
                    .increment(1);
                self.command("EVAL", keys, &args).query_async(con).await
            }
            other => other,
        }
    }

    /// `EVALSHA <sha>` or `EVAL <body>`, then the keys and the arguments.
    fn command<K: AsRef<[u8]>>(&self, verb: &str, keys: &[K], args: impl Fn(&mut Cmd)) -> Cmd {
        // Room for the keys and a hold's arguments from the start, instead
        // of growing the buffers step by step (about ten reallocations).
        let key_bytes: usize = keys.iter().map(|k| k.as_ref().len()).sum();
        let mut cmd = Cmd::with_capacity(keys.len() + 24, key_bytes + 512);
        cmd.arg(verb);
        cmd.arg(if verb == "EVAL" {
            self.body
        } else {
            self.sha.as_str()
        })
        .arg(keys.len());
        for key in keys {
            cmd.arg(key.as_ref());
        }
        args(&mut cmd);
        cmd
    }

    /// Runs the script on the node an `ASK` redirect named: `ASKING` and
    /// then `EVAL` with the body, in one pipeline, so that the flag goes
    /// with this very command and a node that never saw the script runs it.
    pub async fn run_asking<C, T, K>(
        &self,
        con: &mut C,
        keys: &[K],
        args: impl Fn(&mut Cmd),
    ) -> RedisResult<T>
    where
        C: ConnectionLike + Send,
        T: FromRedisValue,
        K: AsRef<[u8]>,
    {
        let (reply,): (T,) = redis::pipe()
            .cmd("ASKING")
            .ignore()
            .add_command(self.command("EVAL", keys, args))
            .query_async(con)
            .await?;
        Ok(reply)
    }
}

/// Every script seathold runs.
#[derive(Debug, Clone)]
pub struct Scripts {
    /// `lua/hold.lua`: all-or-nothing hold of one or more seats.
    pub hold: Script,
    /// `lua/release.lua`: token-checked release.
    pub release: Script,
    /// `lua/extend.lua`: token-checked extend with the lifetime cap.
    pub extend: Script,
    /// `lua/confirm.lua`: token-checked sale, idempotent.
    pub confirm: Script,
    /// `lua/lookup.lua`: read a hold or sale record.
    pub lookup: Script,
    /// `lua/seats.lua`: seat states.
    pub seats: Script,
    /// `lua/abandon.lua`: undo (or forestall) a hold answered 503.
    pub abandon: Script,
    /// `lua/sweep.lua`: `expired` events of one show, exactly once.
    pub sweep: Script,
    /// `lua/events.lua`: a show's events after a cursor.
    pub events: Script,
    /// `lua/pool.lua`: read, create or resize a pool.
    pub pool: Script,
    /// `lua/settings.lua`: a show's settings.
    pub settings: Script,
    /// `lua/forget.lua`: remove a failed confirm's idempotency record.
    pub forget: Script,
    /// `lua/modify.lua`: change a hold's seats and pool units.
    pub modify: Script,
    /// `lua/delete_show.lua`: `seathold delete-show`'s checked deletion.
    pub delete_show: Script,
}

impl Scripts {
    /// The scripts of `lua/`, as compiled into this binary.
    pub fn embedded() -> Self {
        Self {
            hold: Script::new("hold", include_str!("../lua/hold.lua")),
            release: Script::new("release", include_str!("../lua/release.lua")),
            extend: Script::new("extend", include_str!("../lua/extend.lua")),
            confirm: Script::new("confirm", include_str!("../lua/confirm.lua")),
            lookup: Script::new("lookup", include_str!("../lua/lookup.lua")),
            seats: Script::new("seats", include_str!("../lua/seats.lua")),
            abandon: Script::new("abandon", include_str!("../lua/abandon.lua")),
            sweep: Script::new("sweep", include_str!("../lua/sweep.lua")),
            events: Script::new("events", include_str!("../lua/events.lua")),
            pool: Script::new("pool", include_str!("../lua/pool.lua")),
            settings: Script::new("settings", include_str!("../lua/settings.lua")),
            forget: Script::new("forget", include_str!("../lua/forget.lua")),
            modify: Script::new("modify", include_str!("../lua/modify.lua")),
            delete_show: Script::new("delete_show", include_str!("../lua/delete_show.lua")),
        }
    }

    /// All scripts, for loading them.
    pub fn all(&self) -> [&Script; 14] {
        [
            &self.hold,
            &self.release,
            &self.extend,
            &self.confirm,
            &self.lookup,
            &self.seats,
            &self.abandon,
            &self.sweep,
            &self.events,
            &self.pool,
            &self.settings,
            &self.modify,
            &self.forget,
            &self.delete_show,
        ]
    }
}
