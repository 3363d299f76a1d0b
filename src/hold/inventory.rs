//! Pools and show settings: `lua/pool.lua`, `lua/settings.lua`.

use redis::Value;

use super::plan::ints;
use super::Service;
use crate::cluster::Deadline;
use crate::error::Error;
use crate::ids::{PoolId, ShowId};
use crate::model::{Pool, Settings};

impl Service {
    /// Reads pool `pool` of `show`, or creates or resizes it to `capacity`.
    pub async fn pool(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        pool: &PoolId,
        capacity: Option<u64>,
    ) -> Result<Pool, Error> {
        let keys = [
            self.keys.pool(show, pool.as_str()),
            self.keys.pool_holds(show, pool.as_str()),
            self.keys.events(show),
        ];
        let reply: Vec<Value> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().pool, &keys, |c| {
                c.arg(capacity.map(|n| n.to_string()).unwrap_or_default())
                    .arg(
                        self.limits
                            .events_max_len
                            .map(|n| n.to_string())
                            .unwrap_or_default(),
                    )
                    .arg(pool.as_str());
            })
            .await?;
        match ints(&reply).unwrap_or_default().as_slice() {
            [total, held, sold, written] => {
                if *written == 1 {
                    metrics::counter!(crate::metrics::EVENTS, "type" => "pool_changed")
                        .increment(1);
                }
                Ok(Pool::new(show.clone(), pool.clone(), *total, *held, *sold))
            }
            [-1] => Err(Error::PoolNotFound),
            _ => Err(Error::Internal(format!(
                "unexpected reply of pool.lua: {reply:?}"
            ))),
        }
    }

    /// Sets `show`'s most seats plus pool units per holder (0: no limit).
    pub async fn settings(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        max_per_holder: u64,
    ) -> Result<Settings, Error> {
        let keys = [self.keys.settings(show)];
        let stored: i64 = self
            .cluster
            .eval(deadline, &self.cluster.scripts().settings, &keys, |c| {
                c.arg(max_per_holder);
            })
            .await?;
        Ok(Settings {
            show: show.clone(),
            max_per_holder: u64::try_from(stored).unwrap_or(0),
        })
    }
}
