//! The configuration loaders of the gateway and the agent: any text as the YAML file must give a
//! configuration or an error naming what is wrong, never a panic (also for what validation then
//! makes of a configuration that parsed).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tether_agent::config::AgentConfig;
use tether_gateway::GatewayConfig;
use tether_tunnel::settings::from_yaml;

fuzz_target!(|input: &[u8]| {
    let Some((which, text)) = input.split_first() else { return };
    let Ok(text) = std::str::from_utf8(text) else { return };
    if which % 2 == 0 {
        if let Ok(config) = from_yaml::<GatewayConfig>(None, Some(text)) {
            let _ = config.validate_with(false);
        }
    } else if let Ok(config) = from_yaml::<AgentConfig>(None, Some(text)) {
        let _ = config.validate_with(false);
    }
});
