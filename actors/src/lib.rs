//! deepinfer-actors: the runtime. A ractor supervisor tree (frontend, one scheduler and one rank
//! per DP attention rank, expert groups, EPLB, DSpark, replay), the `Engine` embedding API and the
//! metrics. The only async crate of the workspace.
