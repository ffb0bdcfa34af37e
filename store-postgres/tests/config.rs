//! Settings that only a real server can confirm took effect.

mod common;

use common::{pg_available, unique_schema};
use outbox_conformance_tests::pg_url;
use outbox_store_postgres::sqlx;
use outbox_store_postgres::{PgConfig, PgStore};

/// `url` with one more query parameter.
fn with_param(url: &str, param: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{param}")
}

/// The `application_name` of `connections` pooled connections held at once (so they are
/// distinct connections, not one reused), and how many sessions the server lists under `name`.
async fn names_seen(store: &PgStore, connections: usize, name: &str) -> (Vec<String>, i64) {
    let mut held = Vec::new();
    let mut names = Vec::new();
    for _ in 0..connections {
        let mut conn = store.pool().acquire().await.expect("acquire a pooled connection");
        let name: String = sqlx::query_scalar("SELECT current_setting('application_name')")
            .fetch_one(&mut *conn)
            .await
            .expect("read application_name");
        names.push(name);
        held.push(conn);
    }
    let listed: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
        .bind(name)
        .fetch_one(&mut *held[0])
        .await
        .expect("read pg_stat_activity");
    (names, listed)
}

#[tokio::test]
async fn with_application_name_names_every_pooled_connection() {
    if !pg_available() {
        return;
    }
    let name = unique_schema("builder");
    let config = PgConfig::from_url(&pg_url()).unwrap().with_application_name(name.clone());
    let store = PgStore::connect(config).await.expect("connect");
    let (names, listed) = names_seen(&store, 3, &name).await;
    assert_eq!(names, [name.clone(), name.clone(), name.clone()]);
    assert!(listed >= 3, "pg_stat_activity lists {listed} sessions named {name}, expected at least 3");
    store.pool().close().await;
}

#[tokio::test]
async fn a_url_application_name_works_and_the_builder_overrides_it() {
    if !pg_available() {
        return;
    }
    let from_url = unique_schema("url");
    let url = with_param(&pg_url(), &format!("application_name={from_url}"));
    let store = PgStore::connect(PgConfig::from_url(&url).unwrap()).await.expect("connect");
    let (names, _) = names_seen(&store, 2, &from_url).await;
    assert_eq!(names, [from_url.clone(), from_url.clone()]);
    store.pool().close().await;

    let builder = unique_schema("override");
    let store = PgStore::connect(PgConfig::from_url(&url).unwrap().with_application_name(builder.clone()))
        .await
        .expect("connect");
    let (names, listed) = names_seen(&store, 2, &builder).await;
    assert_eq!(names, [builder.clone(), builder.clone()]);
    assert!(listed >= 2, "pg_stat_activity lists {listed} sessions named {builder}");
    store.pool().close().await;
}

#[tokio::test]
async fn an_unknown_outbox_parameter_fails_before_connecting() {
    // Port 1: were the parameter ignored, the error would be a connection failure instead.
    let err = PgStore::connect(PgConfig::from_url("postgres://u:hunter2@127.0.0.1:1/test").unwrap())
        .await
        .expect_err("nothing listens on port 1");
    assert_eq!(err.kind(), outbox_core::ErrorKind::Connection, "{err}");
    let err = PgConfig::from_url("postgres://u:hunter2@127.0.0.1:1/test?outbox_shema=x").unwrap_err();
    assert_eq!(err.kind(), outbox_core::ErrorKind::Config, "{err}");
    let text = format!("{err} {err:?}");
    assert!(text.contains("outbox_shema") && text.contains("outbox_schema"), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
}
