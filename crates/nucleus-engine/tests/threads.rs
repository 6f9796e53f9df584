//! The thread count's order of precedence (`nucleus_engine::threads`). One test: it sets
//! environment variables, which tests running in parallel threads of this process would race on.

use nucleus_engine::threads::{configure, decide, ThreadsSource};

#[test]
fn explicit_then_nucleus_then_rayon_then_physical_cores() {
    std::env::remove_var("NUCLEUS_NUM_THREADS");
    std::env::remove_var("RAYON_NUM_THREADS");
    let (n, source) = decide(None).expect("physical cores");
    assert_eq!(source, ThreadsSource::PhysicalCores);
    let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        n >= 1 && n <= allowed,
        "{n} physical cores, {allowed} allowed"
    );

    std::env::set_var("RAYON_NUM_THREADS", "3");
    assert_eq!(decide(None).expect("rayon"), (3, ThreadsSource::RayonEnv));
    std::env::set_var("NUCLEUS_NUM_THREADS", "5");
    assert_eq!(
        decide(None).expect("nucleus"),
        (5, ThreadsSource::NucleusEnv)
    );
    assert_eq!(
        decide(Some(2)).expect("explicit"),
        (2, ThreadsSource::Explicit)
    );

    // Bad values are errors naming the variable, not a silent default.
    std::env::set_var("NUCLEUS_NUM_THREADS", "lots");
    let e = decide(None).expect_err("not a number").to_string();
    assert!(
        e.contains("NUCLEUS_NUM_THREADS=`lots` is not a thread count between 1 and 1024"),
        "{e}"
    );
    // 0 and counts that would take the machine (99,999 threads per pool) are refused.
    for bad in ["0", "99999", "-1"] {
        std::env::set_var("NUCLEUS_NUM_THREADS", bad);
        assert!(decide(None).is_err(), "{bad}");
    }
    assert!(decide(Some(0)).is_err());
    assert!(decide(Some(1025)).is_err());
    assert_eq!(
        decide(Some(1024)).expect("the most"),
        (1024, ThreadsSource::Explicit)
    );

    // configure exports the decision for candle and sizes rayon's global pool.
    std::env::remove_var("NUCLEUS_NUM_THREADS");
    assert_eq!(
        configure(Some(2)).expect("configure"),
        (2, ThreadsSource::Explicit)
    );
    assert_eq!(std::env::var("RAYON_NUM_THREADS").as_deref(), Ok("2"));
    assert_eq!(std::env::var("CANDLE_NUM_THREADS").as_deref(), Ok("2"));
    assert_eq!(rayon::current_num_threads(), 2);
}
